// selftest.wgsl — evaluates the scalar helpers of common.wgsl on given inputs,
// Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
// P = R + 2N, M = B*L rows, V vocab, T scan chunk. common.wgsl is prepended by the loader.
// so tests can compare them with NumPy (expm1, log1p, softplus, ...).
//
// eval_helpers bindings (one invocation per input):
//   0 p    uniform   Params (n inputs)
//   1 x    (n)       read
//   2 out  (5, n)    read_write  rows: expm1_f(x), log1p_pos(|x|), softplus(x),
//                                zoh_dfactor(x), sigmoid(x)

struct Params { n: u32 }

override WG: u32 = 64u;
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn eval_helpers(@builtin(local_invocation_index) li: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    let v = x[i];
    out[i] = expm1_f(v);
    out[p.n + i] = log1p_pos(abs(v));
    out[2u * p.n + i] = softplus(v);
    out[3u * p.n + i] = zoh_dfactor(v);
    out[4u * p.n + i] = sigmoid(v);
}
