// embedding.wgsl — token embedding lookup and its gradient (model only; the
// CPU side is in mamba_ext/cpu/model.pyx). common.wgsl is prepended by the loader.
//
// Size letters: M = B*L rows, Dm dModel, V vocab.
//
// embedding_forward bindings (one invocation per (r, i), n = M*Dm):
// | binding | name | shape   | access                                          |
// |---------|------|---------|-------------------------------------------------|
// | 0       | p    | Params  | uniform                                         |
// | 1       | tok  | (M,)    | read (u32 ids, validated on the host)           |
// | 2       | w    | (..)    | read: parameter arena, embedding (V, Dm) at e_off |
// | 3       | h    | (M, Dm) | read_write: h[r, i] = embedding[tok[r], i]      |
// embedding_backward bindings (one invocation per (v, i), n = V*Dm): the
// positions of each id come sorted from the host (CSR), so every gradient row
// is summed by one invocation in position order: no atomics, deterministic.
// | 1       | offs | (V+1,)  | read: positions of id v are pos[offs[v] .. offs[v+1]) |
// | 2       | pos  | (M,)    | read: row indices grouped by id                 |
// | 3       | dh   | (M, Dm) | read: dLoss/dh0                                 |
// | 4       | g    | (..)    | read_write: gradient arena, embedding at e_off (+=) |

struct Params { n: u32, Dm: u32, e_off: u32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> f_tok: array<u32>;
@group(0) @binding(2) var<storage, read> f_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> f_h: array<f32>;

@compute @workgroup_size(WG)
fn embedding_forward(@builtin(local_invocation_index) li: u32,
                     @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = flat_index(wid, nwg, li, WG);
    if (idx >= p.n) { return; }
    let r = idx / p.Dm;
    let i = idx % p.Dm;
    f_h[idx] = f_w[p.e_off + f_tok[r] * p.Dm + i];
}

@group(0) @binding(1) var<storage, read> b_offs: array<u32>;
@group(0) @binding(2) var<storage, read> b_pos: array<u32>;
@group(0) @binding(3) var<storage, read> b_dh: array<f32>;
@group(0) @binding(4) var<storage, read_write> b_g: array<f32>;

@compute @workgroup_size(WG)
fn embedding_backward(@builtin(local_invocation_index) li: u32,
                      @builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = flat_index(wid, nwg, li, WG);
    if (idx >= p.n) { return; }
    let v = idx / p.Dm;
    let i = idx % p.Dm;
    var s = 0.0;
    for (var q = b_offs[v]; q < b_offs[v + 1u]; q++) {
        s += b_dh[b_pos[q] * p.Dm + i];
    }
    b_g[p.e_off + idx] = b_g[p.e_off + idx] + s;
}
