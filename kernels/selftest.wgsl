// selftest.wgsl — probes for tests and the benchmark, not steps of the model:
// eval_helpers evaluates the scalar helpers of common.wgsl on given inputs so
// tests can compare them with NumPy (expm1, log1p, softplus, ...); copy_vec4
// measures the copy bandwidth. common.wgsl is prepended by the loader.
//
// Size letters: n inputs (or vec4 elements for copy_vec4).
//
// eval_helpers bindings (one invocation per input):
// | binding | name | shape  | access                                            |
// |---------|------|--------|---------------------------------------------------|
// | 0       | p    | Params | uniform (n inputs)                                |
// | 1       | x    | (n)    | read                                              |
// | 2       | out  | (4, n) | read_write: rows expm1_f(x), log1p_pos(|x|),       |
// |         |      |        | softplus(x), sigmoid(x)                            |

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
    out[3u * p.n + i] = sigmoid(v);
}

// copy_vec4 (bandwidth probe of the benchmark; n = number of vec4):
// | 1 | src | (4n) | read |  2 | dst | (4n) | read_write |
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
