// reduce.wgsl — deterministic column sums (no float atomics anywhere), shared by
// the bias gradients of linear layers (linear_backward's dbias = colsum(dY)), the
// RMSNorm gain gradients (colsum of rmsnorm_backward's per-row terms) and dD_vec
// (colsum of dy * u). common.wgsl is prepended by the loader.
//
// Size letters: M = B*L rows; Params.C columns summed.
//
//   out[o_off + j] += sum_r a[a_off + r*a_rs + j] * b(r, j)
//   b(r, j) = b[b_off + r*b_rs + j] if use_b = 1, else 1
//
// Workgroup = 32 columns x 8 row groups; each invocation sums a strided set of
// rows, then the 8 partials are added in a fixed order.
//
// column_sum bindings:
// | binding | name | shape   | access                                       |
// |---------|------|---------|----------------------------------------------|
// | 0       | p    | Params  | uniform                                      |
// | 1       | a    | (M, ..) | read                                         |
// | 2       | b    | (M, ..) | read (bound to any buffer when use_b = 0)    |
// | 3       | out  | (..)    | read_write (gradient arena, +=)              |

struct Params { M: u32, C: u32, a_off: u32, a_rs: u32, b_off: u32, b_rs: u32, o_off: u32, use_b: u32 }

var<workgroup> red: array<f32, 256>;   // (8, 32) partial sums

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(32, 8)
fn column_sum(@builtin(local_invocation_id) lid: vec3<u32>,
              @builtin(workgroup_id) wid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = (wid.y * nwg.x + wid.x) * 32u + lid.x;
    var s = 0.0;
    if (j < p.C) {
        for (var r = lid.y; r < p.M; r += 8u) {
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
        out[p.o_off + j] = out[p.o_off + j] + tot;
    }
}
