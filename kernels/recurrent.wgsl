// recurrent.wgsl — one step of generation: the conv and the scan of every layer advance
// by one token from their state, for a batch of sequences. The GPU side of
// mamba_ext/cpu/recurrent.pyx (the projections, norms and gate are the kernels of the
// chunked path with M = B rows). common.wgsl is prepended by the loader.
//
// Size letters: B batch (rows), D dInner, N dState, K dConv, R dtRank, P = R + 2N.
//
//   recurrent_conv_step:  conv = bConv + wConv[:, 0] xc + sum_{k>=1} wConv[:, k] tail[K-1-k]
//                         (tail (B, D, K-1), oldest first), u = SiLU(conv); the tail
//                         shifts by one and takes xc
//   recurrent_scan_step:  delta = softplus(delta_pre), per n: a = exp(delta A),
//                         h = a h + coef Bs u (coef = expm1(delta A)/A ZOH | delta Euler),
//                         y = sum_n Cs h + D_vec u
//
// Bindings (one invocation per (b, d)):
// | entry               | binding: name shape access                                     |
// |---------------------|----------------------------------------------------------------|
// | recurrent_conv_step | 0 p Params uniform; 1 Y (B, 2D) r (xc = columns 0..D);          |
// |                     | 2 w arena r (wConv (D, K) at w_off, bConv at b_off);            |
// |                     | 3 tail (B, D, K-1) rw; 4 u (B, D) rw                            |
// | recurrent_scan_step | 0 p Params uniform; 1 xproj (B, P) r (Bs at R, Cs at R+N);      |
// |                     | 2 w arena r (A_log (D, N) at w_off, D_vec at b_off);            |
// |                     | 3 h (B, D, N) rw; 4 u (B, D) r; 5 delta_pre (B, D) r;           |
// |                     | 6 y (B, D) rw                                                   |

struct Params { B: u32, D: u32, K: u32, N: u32, R: u32, P: u32, w_off: u32, b_off: u32,
                zoh: u32 }

override WG: u32 = 128u;
override a_log_min: f32;
override a_log_max: f32;

@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> c_Y: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> c_tail: array<f32>;
@group(0) @binding(4) var<storage, read_write> c_u: array<f32>;

@compute @workgroup_size(WG)
fn recurrent_conv_step(@builtin(local_invocation_index) li: u32,
                       @builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.B * p.D) { return; }
    let b = i / p.D;
    let d = i % p.D;
    let xc = c_Y[b * 2u * p.D + d];
    let km1 = p.K - 1u;
    let t0 = (b * p.D + d) * km1;              // this channel's tail, oldest first
    var s = w[p.b_off + d] + w[p.w_off + d * p.K] * xc;
    for (var k = 1u; k < p.K; k++) { s += w[p.w_off + d * p.K + k] * c_tail[t0 + km1 - k]; }
    for (var j = 0u; j + 1u < km1; j++) { c_tail[t0 + j] = c_tail[t0 + j + 1u]; }
    if (km1 > 0u) { c_tail[t0 + km1 - 1u] = xc; }
    c_u[i] = silu(s);
}

@group(0) @binding(1) var<storage, read> s_xproj: array<f32>;
@group(0) @binding(3) var<storage, read_write> s_h: array<f32>;
@group(0) @binding(4) var<storage, read> s_u: array<f32>;
@group(0) @binding(5) var<storage, read> s_delta_pre: array<f32>;
@group(0) @binding(6) var<storage, read_write> s_y: array<f32>;

@compute @workgroup_size(WG)
fn recurrent_scan_step(@builtin(local_invocation_index) li: u32,
                       @builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.B * p.D) { return; }
    let b = i / p.D;
    let d = i % p.D;
    let dl = softplus(s_delta_pre[i]);
    let uu = s_u[i];
    var y = 0.0;
    for (var n = 0u; n < p.N; n++) {
        let A = -exp(clamp(w[p.w_off + d * p.N + n], a_log_min, a_log_max));
        let x = dl * A;
        let ex = exp(x);
        var coef = dl;
        if (p.zoh == 1u) { coef = expm1_f(x) / A; }
        let k = (b * p.D + d) * p.N + n;
        let h = ex * s_h[k] + coef * s_xproj[b * p.P + p.R + n] * uu;
        s_h[k] = h;
        y += s_xproj[b * p.P + p.R + p.N + n] * h;
    }
    s_y[i] = y + w[p.b_off + d] * uu;
}
