// activations.wgsl — elementwise kernels: the SiLU gate. The GPU side of
// mamba_ext/cpu/activations.pxd (whose scalar helpers are common.wgsl; softplus
// of dt_proj's output is fused into linear.wgsl's store, its backward into
// scan_backward_grads). common.wgsl is prepended by the loader.
// One invocation per element, over a 2-D grid (flat_index).
//
// Size letters: M = B*L rows, D dInner.
//
// gate_forward bindings: gated = y * SiLU(z), z = Y[:, D:2D]
// | binding | name      | shape   | access                               |
// |---------|-----------|---------|--------------------------------------|
// | 0       | p         | Params  | uniform (n = M*D)                    |
// | 1       | y         | (M, D)  | read (scan output incl. the D_vec skip) |
// | 2       | Y         | (M, 2D) | read (in_proj output [xc | z]; row stride y_rs) |
// | 3       | gated     | (M, D)  | read_write                           |
// gate_backward bindings (y and Y f32 or, with HALF, f16 pairs: two per word, element e
// in half e % 2; the f16 mode's cache, read where it is used):
// | 1       | dgated    | (M, D)  | read                                 |
// | 2       | y         | (M, D)  | read (f32 or f16)                    |
// | 3       | Y         | (M, 2D) | read (f32 or f16)                    |
// | 4       | dy        | (M, D)  | read_write: dgated * SiLU(z)         |
// | 5       | dY        | (M, 2D) | read_write: dY[:, D:2D] = dgated * y * SiLU'(z) (the z half) |

struct Params { n: u32, D: u32, y_rs: u32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;

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

override HALF: bool = false;
@group(0) @binding(1) var<storage, read> gb_dgated: array<f32>;
@group(0) @binding(2) var<storage, read> gb_y: array<u32>;
@group(0) @binding(3) var<storage, read> gb_Y: array<u32>;

@group(0) @binding(4) var<storage, read_write> gb_dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> gb_dY: array<f32>;

@compute @workgroup_size(WG)
fn gate_backward(@builtin(local_invocation_index) li: u32,
                 @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    let zi = (i / p.D) * p.y_rs + p.D + i % p.D;
    let z = act_value(gb_Y[act_word(zi, HALF)], zi, HALF);
    let g = gb_dgated[i];
    gb_dy[i] = g * silu(z);
    gb_dY[zi] = g * act_value(gb_y[act_word(i, HALF)], i, HALF) * dsilu(z);
}
