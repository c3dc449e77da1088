// reduce.wgsl — deterministic reductions (no float atomics anywhere).
// Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
// P = R + 2N, M = B*L rows, V vocab, T scan chunk. common.wgsl is prepended by the loader.
//
// reduce_cols: column sums out[o_off + j] += sum_r a[a_off + r*a_rs + j] * b(r, j),
//   b(r, j) = b[b_off + r*b_rs + j] if use_b else 1. Bias gradients (colsum of
//   dY), RMSNorm gain gradients (colsum of rmsnorm_backward's gw rows) and
//   dD_vec (colsum of dy*u). Workgroup = 32 columns x 8 row groups; each
//   invocation sums a strided set of rows, then 8 partials are added in order.
//   0 p    uniform  ColParams
//   1 a    (M, ..)  read
//   2 b    (M, ..)  read        (bound to any buffer when use_b = 0)
//   3 out  (..)     read_write  gradient arena (+=)
// sumsq_partial: per workgroup of WG, the sum of squares and the count of
//   non-finite values of WG*ITEMS consecutive elements of x.
//   0 p     uniform  SqParams (n elements)
//   1 x     (n)      read
//   2 part  (2*G)    read_write  (sumsq, nonfinite) per workgroup, G workgroups
// sumsq_final: one workgroup adds the G partials in a fixed order.
//   1 part  (2*G)    read
//   2 stat  (4)      read_write  stat[0] = sum of squares, stat[1] = non-finite count

struct ColParams { M: u32, C: u32, a_off: u32, a_rs: u32, b_off: u32, b_rs: u32, o_off: u32, use_b: u32 }
struct SqParams { n: u32, groups: u32 }

override WG: u32 = 256u;
const ITEMS: u32 = 8u;

var<workgroup> red: array<f32, 256>;
var<workgroup> red2: array<f32, 256>;

@group(0) @binding(0) var<uniform> cp: ColParams;
@group(0) @binding(1) var<storage, read> c_a: array<f32>;
@group(0) @binding(2) var<storage, read> c_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c_out: array<f32>;

@compute @workgroup_size(32, 8)
fn reduce_cols(@builtin(local_invocation_id) lid: vec3<u32>,
               @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = (wid.y * nwg.x + wid.x) * 32u + lid.x;
    var s = 0.0;
    if (j < cp.C) {
        for (var r = lid.y; r < cp.M; r += 8u) {
            var v = c_a[cp.a_off + r * cp.a_rs + j];
            if (cp.use_b == 1u) { v *= c_b[cp.b_off + r * cp.b_rs + j]; }
            s += v;
        }
    }
    red[lid.y * 32u + lid.x] = s;
    workgroupBarrier();
    if (lid.y == 0u && j < cp.C) {
        var tot = 0.0;
        for (var q = 0u; q < 8u; q++) { tot += red[q * 32u + lid.x]; }
        c_out[cp.o_off + j] = c_out[cp.o_off + j] + tot;
    }
}

@group(0) @binding(0) var<uniform> sp: SqParams;
@group(0) @binding(1) var<storage, read> s_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> s_part: array<f32>;

// Tree sums of red and red2 over 256 slots (fixed order).
fn tree2(li: u32) {
    for (var h = 128u; h > 0u; h = h / 2u) {
        if (li < h) { red[li] += red[li + h]; red2[li] += red2[li + h]; }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn sumsq_partial(@builtin(local_invocation_index) li: u32,
                 @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = wid.y * nwg.x + wid.x;
    var ss = 0.0;
    var bad = 0.0;
    for (var q = 0u; q < ITEMS; q++) {
        let i = (g * ITEMS + q) * 256u + li;
        if (i < sp.n) {
            let v = s_x[i];
            if (not_finite(v)) { bad += 1.0; } else { ss += v * v; }
        }
    }
    red[li] = ss;
    red2[li] = bad;
    workgroupBarrier();
    tree2(li);
    if (li == 0u && g < sp.groups) { s_part[2u * g] = red[0]; s_part[2u * g + 1u] = red2[0]; }
}

@group(0) @binding(1) var<storage, read> f_part: array<f32>;
@group(0) @binding(2) var<storage, read_write> f_stat: array<f32>;

@compute @workgroup_size(256)
fn sumsq_final(@builtin(local_invocation_index) li: u32) {
    var ss = 0.0;
    var bad = 0.0;
    for (var g = li; g < sp.groups; g += 256u) { ss += f_part[2u * g]; bad += f_part[2u * g + 1u]; }
    red[li] = ss;
    red2[li] = bad;
    workgroupBarrier();
    tree2(li);
    if (li == 0u) { f_stat[0] = red[0]; f_stat[1] = red2[0]; }
}
