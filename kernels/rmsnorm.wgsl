// rmsnorm.wgsl — RMSNorm forward and backward, one workgroup per row.
// Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
// P = R + 2N, M = B*L rows, V vocab, T scan chunk. common.wgsl is prepended by the loader.
//
//   inv[r] = 1 / sqrt(mean_i x[r,i]^2 + eps),  xn[r,i] = x[r,i] * inv[r] * w[i]
//
// rmsnorm_forward bindings:
//   0 p    uniform     Params
//   1 x    (M, C)      read        input rows (C = Dm)
//   2 w    (..)        read        parameter arena; gain w at w_off, (C)
//   3 xn   (M, C)      read_write  normalised output
//   4 inv  (M)         read_write  saved 1/rms per row
// rmsnorm_backward bindings:
//   0 p    uniform     Params
//   1 x    (M, C)      read        saved input
//   2 w    (..)        read        parameter arena; gain at w_off
//   3 dxn  (M, C)      read        gradient w.r.t. xn
//   4 inv  (M)         read        saved 1/rms
//   5 dx   (M, C)      read_write  dx += inv*w*dxn - x * inv^3 / C * sum_i(w*dxn*x)
//   6 gw   (M, C)      read_write  per-row terms dxn*x*inv of dLoss/dw; the
//                                  column sum (reduce.wgsl) gives dw without atomics
// Rows are split over a 2-D grid (flat_index) when M exceeds the workgroup limit.

struct Params { M: u32, C: u32, w_off: u32, eps: f32 }

override WG: u32 = 128u;

@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> f_x: array<f32>;
@group(0) @binding(2) var<storage, read> f_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> f_xn: array<f32>;
@group(0) @binding(4) var<storage, read_write> f_inv: array<f32>;

// #include block_reduce.wgsl

@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(local_invocation_index) li: u32,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;          // uniform per workgroup
    let valid = r < p.M;
    let base = r * p.C;
    var ss = 0.0;
    if (valid) {
        for (var i = li; i < p.C; i += WG) { let v = f_x[base + i]; ss += v * v; }
    }
    let total = block_reduce(li, ss, false);
    if (!valid) { return; }
    let inv = 1.0 / sqrt(total / f32(p.C) + p.eps);
    for (var i = li; i < p.C; i += WG) {
        f_xn[base + i] = f_x[base + i] * inv * f_w[p.w_off + i];
    }
    if (li == 0u) { f_inv[r] = inv; }
}

@group(0) @binding(1) var<storage, read> b_x: array<f32>;
@group(0) @binding(2) var<storage, read> b_w: array<f32>;
@group(0) @binding(3) var<storage, read> b_dxn: array<f32>;
@group(0) @binding(4) var<storage, read> b_inv: array<f32>;
@group(0) @binding(5) var<storage, read_write> b_dx: array<f32>;
@group(0) @binding(6) var<storage, read_write> b_gw: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(local_invocation_index) li: u32,
                    @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;
    let valid = r < p.M;
    let base = r * p.C;
    var inv = 0.0;
    var dot = 0.0;
    if (valid) {
        inv = b_inv[r];
        for (var i = li; i < p.C; i += WG) {
            dot += b_w[p.w_off + i] * b_dxn[base + i] * b_x[base + i];
        }
    }
    let total = block_reduce(li, dot, false);
    if (!valid) { return; }
    let k = inv * inv * inv * total / f32(p.C);
    for (var i = li; i < p.C; i += WG) {
        let g = b_dxn[base + i];
        let xv = b_x[base + i];
        b_dx[base + i] = b_dx[base + i] + inv * b_w[p.w_off + i] * g - xv * k;
        b_gw[base + i] = g * xv * inv;
    }
}
