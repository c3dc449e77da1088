// rmsnorm.wgsl — RMSNorm forward and backward, one workgroup per row. The GPU
// side of mamba_ext/cpu/rmsnorm.pyx. common.wgsl is prepended by the loader.
//
// Size letters: M = B*L rows, Dm dModel (Params.C, the row length).
//
//   rstd[r] = 1 / sqrt(mean_i x[r,i]^2 + eps),  xn[r,i] = x[r,i] * rstd[r] * w[i]
//   dx[r,i] = dres[r,i] + rstd*w[i]*dxn[r,i] - x[r,i] * rstd^3 / Dm * sum_i(w*dxn*x)
//
// rmsnorm_forward bindings:
// | binding | name | shape   | access                                     |
// |---------|------|---------|--------------------------------------------|
// | 0       | p    | Params  | uniform                                    |
// | 1       | x    | (M, Dm) | read                                       |
// | 2       | w    | (..)    | read (parameter arena; gain (Dm) at w_off) |
// | 3       | xn   | (M, Dm) | read_write                                 |
// | 4       | rstd | (M,)    | read_write (saved for the backward)        |
// rmsnorm_backward bindings:
// | 0       | p    | Params  | uniform                                    |
// | 1       | x    | (M, Dm) | read (saved input)                         |
// | 2       | w    | (..)    | read (parameter arena; gain at w_off)      |
// | 3       | dxn  | (M, Dm) | read (gradient w.r.t. xn)                  |
// | 4       | rstd | (M,)    | read                                       |
// | 5       | dres | (M, Dm) | read (gradient reaching x by the residual path; |
// |         |      |         | the block's dout, the final norm's zeros)  |
// | 6       | dx   | (M, Dm) | read_write (written, not accumulated)      |
// | 7       | gw   | (M, Dm) | read_write: per-row terms dxn*x*rstd of dLoss/dw; |
// |         |      |         | their column sum (reduce.wgsl) gives dw without atomics |
// Rows are split over a 2-D grid (flat_index) when M exceeds the workgroup limit.

struct Params { M: u32, C: u32, w_off: u32, eps: f32, has_res: u32 }

override WG: u32 = 128u;

@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> f_x: array<f32>;
@group(0) @binding(2) var<storage, read> f_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> f_xn: array<f32>;
@group(0) @binding(4) var<storage, read_write> f_rstd: array<f32>;

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
    let rstd = 1.0 / sqrt(total / f32(p.C) + p.eps);
    for (var i = li; i < p.C; i += WG) {
        f_xn[base + i] = f_x[base + i] * rstd * f_w[p.w_off + i];
    }
    if (li == 0u) { f_rstd[r] = rstd; }
}

@group(0) @binding(1) var<storage, read> b_x: array<f32>;
@group(0) @binding(2) var<storage, read> b_w: array<f32>;
@group(0) @binding(3) var<storage, read> b_dxn: array<f32>;
@group(0) @binding(4) var<storage, read> b_rstd: array<f32>;
@group(0) @binding(5) var<storage, read> b_dres: array<f32>;
@group(0) @binding(6) var<storage, read_write> b_dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> b_gw: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(local_invocation_index) li: u32,
                    @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;
    let valid = r < p.M;
    let base = r * p.C;
    var rstd = 0.0;
    var dot = 0.0;
    if (valid) {
        rstd = b_rstd[r];
        for (var i = li; i < p.C; i += WG) {
            dot += b_w[p.w_off + i] * b_dxn[base + i] * b_x[base + i];
        }
    }
    let total = block_reduce(li, dot, false);
    if (!valid) { return; }
    let k = rstd * rstd * rstd * total / f32(p.C);
    for (var i = li; i < p.C; i += WG) {
        let g = b_dxn[base + i];
        let xv = b_x[base + i];
        var d = rstd * b_w[p.w_off + i] * g - xv * k;
        if (p.has_res == 1u) { d += b_dres[base + i]; }
        b_dx[base + i] = d;
        b_gw[base + i] = g * xv * rstd;
    }
}
