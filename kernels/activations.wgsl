// activations.wgsl — elementwise kernels: softplus of dt_proj, the SiLU gate.
// Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
// P = R + 2N, M = B*L rows, V vocab, T scan chunk. common.wgsl is prepended by the loader.
// One invocation per element, over a 2-D grid (flat_index).
//
// softplus_forward bindings:
//   0 p      uniform    Params (n = M*D)
//   1 dpre   (M, D)     read        dt_proj output (pre-softplus)
//   2 delta  (M, D)     read_write  Delta = softplus(dpre)
//   (softplus backward is fused into scan_bwd_grads: dpre gets dDelta * sigmoid(dpre))
// gate_forward bindings:  gated = y * SiLU(z), z = Y[:, D:2D]
//   1 y      (M, D)     read        scan readout + skip
//   2 Y      (M, 2D)    read        in_proj output (z columns)
//   3 gated  (M, D)     read_write
// gate_backward bindings:
//   1 dg     (M, D)     read        dLoss/dgated
//   2 y      (M, D)     read
//   3 Y      (M, 2D)    read
//   4 dy     (M, D)     read_write  dLoss/dy = dg * SiLU(z)
//   5 dY     (M, 2D)    read_write  dY[:, D:2D] = dg * y * SiLU'(z)   (the z half)

struct Params { n: u32, D: u32, y_rs: u32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> s_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> s_out: array<f32>;

@compute @workgroup_size(WG)
fn softplus_forward(@builtin(local_invocation_index) li: u32,
                    @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    s_out[i] = softplus(s_in[i]);
}

@group(0) @binding(1) var<storage, read> gf_y: array<f32>;
@group(0) @binding(2) var<storage, read> gf_Y: array<f32>;
@group(0) @binding(3) var<storage, read_write> gf_out: array<f32>;

@compute @workgroup_size(WG)
fn gate_forward(@builtin(local_invocation_index) li: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    let z = gf_Y[(i / p.D) * p.y_rs + p.D + i % p.D];
    gf_out[i] = gf_y[i] * silu(z);
}

@group(0) @binding(1) var<storage, read> gb_dg: array<f32>;
@group(0) @binding(2) var<storage, read> gb_y: array<f32>;
@group(0) @binding(3) var<storage, read> gb_Y: array<f32>;
@group(0) @binding(4) var<storage, read_write> gb_dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> gb_dY: array<f32>;

@compute @workgroup_size(WG)
fn gate_backward(@builtin(local_invocation_index) li: u32,
                 @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    let zi = (i / p.D) * p.y_rs + p.D + i % p.D;
    let z = gb_Y[zi];
    let g = gb_dg[i];
    gb_dy[i] = g * silu(z);
    gb_dY[zi] = g * gb_y[i] * dsilu(z);
}

// copy_f32 bindings (residual paths: out = x + ..., dx = dout + ...):
//   1 src (n) read, 2 dst (n) read_write
@group(0) @binding(1) var<storage, read> c_src: array<f32>;
@group(0) @binding(2) var<storage, read_write> c_dst: array<f32>;

@compute @workgroup_size(WG)
fn copy_f32(@builtin(local_invocation_index) li: u32,
            @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    c_dst[i] = c_src[i];
}

// copy_vec4 bindings (bandwidth probe of the benchmark; n = number of vec4):
//   1 src (4n) read, 2 dst (4n) read_write
@group(0) @binding(1) var<storage, read> v_src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> v_dst: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn copy_vec4(@builtin(local_invocation_index) li: u32,
             @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    v_dst[i] = v_src[i];
}
