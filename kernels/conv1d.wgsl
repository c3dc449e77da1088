// conv1d.wgsl — depthwise causal convolution over time, fused with SiLU. The
// GPU side of mamba_ext/cpu/conv1d.pyx. common.wgsl is prepended by the loader.
//
// Size letters: B batch, L seqLen, D dInner, K dConv, M = B*L rows.
//
//   conv[b,t,d] = bConv[d] + sum_{k<K, t-k>=0} wConv[d,k] * xc[b,t-k,d],  u = SiLU(conv)
//   (tap k = 0 is the current step; xc = in_proj columns 0..D of Y). conv is not
//   stored: the backward recomputes it from Y (K taps, the same sum: no (M, D) buffer).
//
// conv1d_forward bindings (one invocation per (row r, channel d)):
// | binding | name | shape   | access                                                 |
// |---------|------|---------|--------------------------------------------------------|
// | 0       | p    | Params  | uniform                                                |
// | 1       | Y    | (M, 2D) | read: in_proj output; xc = Y[:, 0:D] (row stride y_rs)  |
// | 2       | w    | (..)    | read: parameter arena, wConv (D, K) at w_off, bConv (D) at b_off |
// | 3       | u    | (M, D)  | read_write: SiLU(conv), the scan input                  |
// conv1d_backward_dconv, then conv1d_backward_input (one invocation per (r, d) each; two
// dispatches, so the second reads what the first wrote):
// | 1       | Y    | (M, 2D) | read (dconv: conv recomputed from its xc columns)        |
// | 2       | w    | (..)    | read: parameter arena                                  |
// | 3       | du   | (M, D)  | read (dconv): dLoss/du (scan path + x_proj path)        |
// | 4       | dconv| (M, D)  | dconv: write du * SiLU'(conv); input: read              |
// | 5       | dY   | (M, 2D) | input: write dY[:, 0:D] = dxc[t] = sum_k wConv[d,k] * dconv[t+k] |
// conv1d_backward_weight bindings (workgroup = 32 channels x 8 row groups;
// grid y = tap k, y = K is the bias; grid z = row block rb of rows_per rows) and
// conv1d_backward_weight_final (one invocation per (k, d): adds the RB partials
// in the order rb = 0..RB-1): no atomics, fixed summation order.
// | 1       | dconv| (M, D)  | read                                                   |
// | 2       | Y    | (M, 2D) | read: saved in_proj output (xc columns)                 |
// | 3       | part | (RB, K+1, D) | read_write: partial sums per row block            |
// | 4       | g    | (..)    | read_write: gradient arena, wConv at w_off, bConv at b_off (+=) |

struct Params { M: u32, L: u32, D: u32, K: u32, y_rs: u32, w_off: u32, b_off: u32,
                rows_per: u32, RB: u32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> Y: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

// conv (before SiLU) of row r (time step t = r % L), channel d.
fn conv_at(r: u32, d: u32) -> f32 {
    let t = r % p.L;
    var s = w[p.b_off + d];
    let kmax = min(p.K, t + 1u);
    for (var k = 0u; k < kmax; k++) {
        s += w[p.w_off + d * p.K + k] * Y[(r - k) * p.y_rs + d];
    }
    return s;
}

@group(0) @binding(3) var<storage, read_write> f_u: array<f32>;

@compute @workgroup_size(WG)
fn conv1d_forward(@builtin(local_invocation_index) li: u32,
                  @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = flat_index(wid, nwg, li, WG);
    if (idx >= p.M * p.D) { return; }
    f_u[idx] = silu(conv_at(idx / p.D, idx % p.D));
}

@group(0) @binding(3) var<storage, read> bi_du: array<f32>;
@group(0) @binding(4) var<storage, read_write> bi_dconv: array<f32>;
@group(0) @binding(5) var<storage, read_write> bi_dY: array<f32>;

@compute @workgroup_size(WG)
fn conv1d_backward_dconv(@builtin(local_invocation_index) li: u32,
                         @builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = flat_index(wid, nwg, li, WG);
    if (idx >= p.M * p.D) { return; }
    bi_dconv[idx] = bi_du[idx] * dsilu(conv_at(idx / p.D, idx % p.D));
}

@compute @workgroup_size(WG)
fn conv1d_backward_input(@builtin(local_invocation_index) li: u32,
                         @builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = flat_index(wid, nwg, li, WG);
    if (idx >= p.M * p.D) { return; }
    let r = idx / p.D;
    let d = idx % p.D;
    let t = r % p.L;
    var s = 0.0;
    let kmax = min(p.K, p.L - t);
    for (var k = 0u; k < kmax; k++) {
        s += w[p.w_off + d * p.K + k] * bi_dconv[idx + k * p.D];
    }
    bi_dY[r * p.y_rs + d] = s;
}

@group(0) @binding(1) var<storage, read> bw_dconv: array<f32>;
@group(0) @binding(2) var<storage, read> bw_Y: array<f32>;
@group(0) @binding(3) var<storage, read_write> bw_part: array<f32>;
@group(0) @binding(4) var<storage, read_write> bw_g: array<f32>;

var<workgroup> red: array<f32, 256>;   // (8, 32) partial sums

@compute @workgroup_size(32, 8)
fn conv1d_backward_weight(@builtin(local_invocation_id) lid: vec3<u32>,
                          @builtin(workgroup_id) wid: vec3<u32>) {
    if (p.M == 0xffffffffu) { bw_g[0] = 0.0; }   // never: keeps g in the auto layout
    let d = wid.x * 32u + lid.x;
    let k = wid.y;                      // k == K: the bias
    let rb = wid.z;
    let r1 = min(p.M, (rb + 1u) * p.rows_per);
    var s = 0.0;
    if (d < p.D) {
        for (var r = rb * p.rows_per + lid.y; r < r1; r += 8u) {
            let g = bw_dconv[r * p.D + d];
            if (k == p.K) {
                s += g;
            } else if (r % p.L >= k) {
                s += g * bw_Y[(r - k) * p.y_rs + d];
            }
        }
    }
    red[lid.y * 32u + lid.x] = s;
    workgroupBarrier();
    if (lid.y == 0u && d < p.D) {
        var tot = 0.0;
        for (var q = 0u; q < 8u; q++) { tot += red[q * 32u + lid.x]; }
        bw_part[(rb * (p.K + 1u) + k) * p.D + d] = tot;
    }
}

@compute @workgroup_size(256)
fn conv1d_backward_weight_final(@builtin(local_invocation_index) li: u32,
                                @builtin(workgroup_id) wid: vec3<u32>,
                                @builtin(num_workgroups) nwg: vec3<u32>) {
    if (p.M == 0xffffffffu) { bw_g[0] = bw_dconv[0] + bw_Y[0]; }   // never (auto layout)
    let e = flat_index(wid, nwg, li, 256u);
    if (e >= (p.K + 1u) * p.D) { return; }
    let k = e / p.D;
    let d = e % p.D;
    var s = 0.0;
    for (var rb = 0u; rb < p.RB; rb++) { s += bw_part[(rb * (p.K + 1u) + k) * p.D + d]; }
    var o = p.w_off + d * p.K + k;
    if (k == p.K) { o = p.b_off + d; }
    bw_g[o] = bw_g[o] + s;
}
