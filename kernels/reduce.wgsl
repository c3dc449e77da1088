// reduce.wgsl — deterministic column sums (no float atomics anywhere), shared by
// the bias gradients of linear layers (linear_backward's dbias = colsum(dY)), the
// RMSNorm gain gradients (colsum of rmsnorm_backward's per-row terms) and dD_vec
// (colsum of dy * u). common.wgsl is prepended by the loader.
//
// Size letters: M = B*L rows; Params.C columns summed; RB row blocks.
//
//   out[o_off + j] += sum_r a[a_off + r*a_rs + j] * b(r, j)
//   b(r, j) = b[b_off + r*b_rs + j] if use_b = 1, else 1
//
// Two passes, so that a (16384, 768) sum keeps a large GPU busy: column_sum
// sums row block rb (rows rb*rows_per .. +rows_per) of 32 columns per
// workgroup (32 columns x 8 row groups, 8 partials added in a fixed order) into
// part[rb, j]; column_sum_final adds the RB partials the same way (32 columns x 8 lanes,
// lane q the row blocks q, q + 8, ... in order, then the lanes in the order q = 0..7).
//
// Bindings (both entry points):
// | binding | name | shape   | access                                       |
// |---------|------|---------|----------------------------------------------|
// | 0       | p    | Params  | uniform                                      |
// | 1       | a    | (M, ..) | read                                         |
// | 2       | b    | (M, ..) | read (bound to any buffer when use_b = 0)    |
// | 3       | part | (RB, C) | read_write (partial sums per row block)      |
// | 4       | out  | (..)    | read_write (gradient arena, +=)              |

struct Params { M: u32, C: u32, a_off: u32, a_rs: u32, b_off: u32, b_rs: u32, o_off: u32,
                use_b: u32, rows_per: u32, RB: u32 }

var<workgroup> red: array<f32, 256>;   // (8, 32) partial sums

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> part: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(32, 8)
fn column_sum(@builtin(local_invocation_id) lid: vec3<u32>,
              @builtin(workgroup_id) wid: vec3<u32>) {
    if (p.M == 0xffffffffu) { out[0] = 0.0; }   // never: keeps `out` in the auto layout
    let j = wid.x * 32u + lid.x;
    let rb = wid.y;
    let r1 = min(p.M, (rb + 1u) * p.rows_per);
    var s = 0.0;
    if (j < p.C) {
        for (var r = rb * p.rows_per + lid.y; r < r1; r += 8u) {
            var v = a[p.a_off + r * p.a_rs + j];
            if (p.use_b == 1u) { v *= b[p.b_off + r * p.b_rs + j]; }
            s += v;
        }
    }
    red[lid.y * 32u + lid.x] = s;
    workgroupBarrier();
    if (lid.y == 0u && j < p.C) {
        var tot = 0.0;
        for (var q = 0u; q < 8u; q++) { tot += red[q * 32u + lid.x]; }
        part[rb * p.C + j] = tot;
    }
}

@compute @workgroup_size(32, 8)
fn column_sum_final(@builtin(local_invocation_id) lid: vec3<u32>,
                    @builtin(workgroup_id) wid: vec3<u32>) {
    if (p.M == 0xffffffffu) { out[0] = a[0] + b[0]; }   // never: keeps a, b in the auto layout
    let j = wid.x * 32u + lid.x;
    var s = 0.0;
    if (j < p.C) {
        for (var rb = lid.y; rb < p.RB; rb += 8u) { s += part[rb * p.C + j]; }
    }
    red[lid.y * 32u + lid.x] = s;
    workgroupBarrier();
    if (lid.y == 0u && j < p.C) {
        var tot = 0.0;
        for (var q = 0u; q < 8u; q++) { tot += red[q * 32u + lid.x]; }
        out[p.o_off + j] = out[p.o_off + j] + tot;
    }
}
