// amp.wgsl — the fp16 rounding of mixed-precision training (the GPU side of
// mamba_ext/amp.py): the weights the forward/backward runs on, and the gradients
// an fp16 backward would hold, unscaled. common.wgsl is prepended by the loader.
//
// Size letters: n elements of the parameter arena.
//
//   round_f16(x): the nearest float16 value (ties to even), as f32; |x| >= 65520
//   becomes +-inf (IEEE overflow), NaN stays NaN, float16 subnormals are kept
//   (quantum 2^-24) — NumPy's x.astype(float16), exactly.
//   amp_round_weights: w16 = round_f16(w)                  (mamba_ext.amp.fp16_view)
//   amp_round_grads:   g = round_f16(g) * inv_scale         (round_fp16, then
//                      DynamicLossScaler.unscale: an overflow stays +-inf, so the
//                      gradient norm's non-finite count sees it); inv_scale given, or
//                      state[1] when use_state
//   amp_update_scale:  DynamicLossScaler.update on the GPU, after AdamW's gradient norm:
//                      state = (scale, 1/scale, growth tracker) advanced by the step's
//                      overflow (stat[1] > 0: AdamW's non-finite count), so that the
//                      next step, submitted before this one is read back, runs with
//                      the scale this one leaves (ResidentTrainer.step_async). The host
//                      runs it only where every product below is exact (the scale and
//                      its factors and bounds powers of two), so the host's scaler, fed
//                      the same overflows, holds the same values bit for bit.
//   amp_pack_f16:      packed (rows, dst_cols) f16 = round_f16(x (rows, cols), row stride
//                      src_rs from src_off), zero in columns cols .. dst_cols - 1, two
//                      per u32 word (the lower half first), from word dst_off: the
//                      operands of the tensor-core products (padded to their whole tiles)
//                      (kernels/linear_f16.wgsl). The f16 bits are formed here, not by
//                      pack2x16float, whose rounding and overflow WGSL leaves to the
//                      implementation: +-inf past 65504, as NumPy's astype(float16).
//                      Several blocks of one shape at once (count = n / per of them, the
//                      m-th from src_off + m src_stride into word dst_off + m dst_stride:
//                      the same matrix of every layer, one dispatch for all).
//   amp_pack_f16_pair: the same (rows, cols) block packed twice: row-major into packed
//                      from word dst_off (when ROW) as amp_pack_f16, and transposed,
//                      (cols, rows) f16, into packed_t from word dst_t_off (when TRANS):
//                      an operand and its k-major transpose (a weight gradient's).
//                      Through a 64 x 64 tile of workgroup memory (as
//                      64 x 32 words of f16 pairs), so that reads and both writes are
//                      coalesced in runs of 128 bytes; rows and cols multiples of 64
//                      (checked on the host); the grid's z the block of several (as
//                      amp_pack_f16's count; packed_t's at word dst_t_off + z dst_t_stride).
//                      With SUM, also the column sums of the f32
//                      block's 64-row tiles, part (rows / 64, cols): a bias gradient read
//                      in the same pass (reduce.wgsl's column_sum_final adds them up, in
//                      tile order; each tile's sum: 8 rows per invocation, then the 8
//                      invocations of a column, in a fixed order).
//
// Size letters: n elements (words of amp_pack_f16: rows * dst_cols / 2), cols (even) per
// row, dst_cols (even, >= cols) per packed row.
//
// Bindings (one invocation per element, per word for amp_pack_f16):
// | entry             | binding: name shape access                                |
// |-------------------|-----------------------------------------------------------|
// | amp_round_weights | 0 p Params uniform; 1 w (n) r; 2 w16 (n) rw               |
// | amp_round_grads   | 0 p Params uniform; 2 g (n) rw; 5 state (4) rw            |
// | amp_pack_f16      | 0 p Params uniform; 1 x r; 3 packed (n words) rw          |
// | amp_pack_f16_pair | 0 p Params uniform; 1 x r; 3 packed rw; 4 packed_t rw;    |
// |                   | 7 part (rows / 64, cols) rw                               |
// | amp_update_scale  | 0 sp ScaleParams uniform; 5 state (4) rw; 6 stat (4) r    |

struct Params { n: u32, inv_scale: f32, cols: u32, src_off: u32, src_rs: u32, dst_off: u32,
                rows: u32, dst_t_off: u32, dst_cols: u32, use_state: u32,
                per: u32, src_stride: u32, dst_stride: u32, dst_t_stride: u32 }
// amp_update_scale's: DynamicLossScaler's factors, their reciprocals, its bounds and theirs
struct ScaleParams { growth: f32, backoff: f32, inv_growth: f32, inv_backoff: f32,
                     interval: f32, lo: f32, hi: f32, inv_lo: f32, inv_hi: f32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read_write> packed: array<u32>;
@group(0) @binding(4) var<storage, read_write> packed_t: array<u32>;
@group(0) @binding(0) var<uniform> sp: ScaleParams;
@group(0) @binding(5) var<storage, read_write> state: array<f32>;   // (4,) scale, 1/scale, tracker, -
@group(0) @binding(6) var<storage, read> stat: array<f32>;          // (4,) AdamW's (kernels/adamw.wgsl)
@group(0) @binding(7) var<storage, read_write> part: array<f32>;    // (rows / 64, cols) column sums
@group(0) @binding(1) var<storage, read> w2: array<vec2<f32>>;      // amp_pack_f16_pair's x: f32 pairs

override ROW: bool = true;                     // amp_pack_f16_pair: the row-major copy
override TRANS: bool = true;                   // the transposed one
override SUM: bool = false;                    // and the column sums of its tiles
var<workgroup> tile: array<u32, 64u * 33u>;    // (64, 32) words of the block's f16 pairs, rows 33 apart
var<workgroup> csum: array<f32, 8u * 64u>;     // (8, 64) column sums of 8 rows each (SUM)

fn round_f16(x: f32) -> f32 {
    if ((bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u) { return x; }   // NaN, payload kept
    return f16_value(f16_bits(x));
}

@compute @workgroup_size(WG)
fn amp_pack_f16(@builtin(local_invocation_index) li: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let ia = flat_index(wid, nwg, li, WG);
    if (ia >= p.n) { return; }
    let m = ia / p.per;                       // which block of the count
    let i = ia % p.per;                       // its word
    let words = p.dst_cols / 2u;              // per packed row
    let col = 2u * (i % words);
    var v = 0u;
    if (col < p.cols) {
        let src = p.src_off + m * p.src_stride + (i / words) * p.src_rs + col;
        v = f16_pair(w[src], w[src + 1u]);
    }
    packed[p.dst_off + m * p.dst_stride + i] = v;
}

@compute @workgroup_size(256)
fn amp_pack_f16_pair(@builtin(local_invocation_index) t: u32,
                     @builtin(workgroup_id) wid: vec3<u32>) {
    let r0 = wid.y * 64u;                      // this workgroup's 64 rows and 64 columns
    let c0 = wid.x * 64u;
    let src_off = p.src_off + wid.z * p.src_stride;     // of block z of the count
    let dst_off = p.dst_off + wid.z * p.dst_stride;
    let dst_t_off = p.dst_t_off + wid.z * p.dst_t_stride;
    var s0 = 0.0;                              // (SUM) columns c0 + 2k, 2k + 1 over this
    var s1 = 0.0;                              // invocation's 8 rows
    // word k = t % 32 of row r = t / 32 + 8 q: columns c0 + 2k, 2k + 1; the eight rows'
    // loads issued before any store (which the compiler cannot tell from them)
    var xs: array<vec2<f32>, 8>;
    for (var q = 0u; q < 8u; q++) {
        xs[q] = w2[(src_off + (r0 + t / 32u + 8u * q) * p.src_rs + c0 + 2u * (t % 32u)) / 2u];
    }
    for (var q = 0u; q < 8u; q++) {
        let r = t / 32u + 8u * q;
        let k = t % 32u;
        let xv = xs[q];                        // (src_off, src_rs even: checked)
        s0 += xv.x;
        s1 += xv.y;
        let v = f16_pair(xv.x, xv.y);
        tile[r * 33u + k] = v;
        if (ROW) { packed[dst_off + (r0 + r) * (p.cols / 2u) + c0 / 2u + k] = v; }
    }
    if (SUM) {
        csum[(t / 32u) * 64u + 2u * (t % 32u)] = s0;
        csum[(t / 32u) * 64u + 2u * (t % 32u) + 1u] = s1;
    }
    workgroupBarrier();
    if (SUM && t < 64u) {
        var tot = 0.0;
        for (var q = 0u; q < 8u; q++) { tot += csum[q * 64u + t]; }
        part[wid.y * p.cols + c0 + t] = tot;
    }
    for (var q = 0u; q < 8u; q++) {            // column c, word j: rows 2j, 2j + 1
        if (!TRANS) { break; }
        let e = t + 256u * q;
        let c = e / 32u;
        let j = e % 32u;
        let s = 16u * (c % 2u);
        let lo = (tile[(2u * j) * 33u + c / 2u] >> s) & 0xffffu;
        let hi = (tile[(2u * j + 1u) * 33u + c / 2u] >> s) & 0xffffu;
        packed_t[dst_t_off + (c0 + c) * (p.rows / 2u) + r0 / 2u + j] = lo | (hi << 16u);
    }
}

@compute @workgroup_size(WG)
fn amp_round_weights(@builtin(local_invocation_index) li: u32,
                     @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    out[i] = round_f16(w[i]);
}

@compute @workgroup_size(WG)
fn amp_round_grads(@builtin(local_invocation_index) li: u32,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    out[i] = round_f16(out[i]) * select(p.inv_scale, state[1], p.use_state == 1u);
}

@compute @workgroup_size(1)
fn amp_update_scale() {
    var scale = state[0];
    var inv_scale = state[1];
    var tracker = state[2];                   // a count, exact in f32 below 2^24
    if (stat[1] > 0.0) {                      // overflow: back off
        scale = scale * sp.backoff;
        inv_scale = inv_scale * sp.inv_backoff;
        tracker = 0.0;
    } else {
        tracker = tracker + 1.0;
        if (tracker == sp.interval) {
            let grown = scale * sp.growth;
            if ((bitcast<u32>(grown) & 0x7f800000u) != 0x7f800000u) {   // finite
                scale = grown;
                inv_scale = inv_scale * sp.inv_growth;
            }
            tracker = 0.0;
        }
    }
    if (scale < sp.lo) { scale = sp.lo; inv_scale = sp.inv_lo; }
    if (scale > sp.hi) { scale = sp.hi; inv_scale = sp.inv_hi; }
    state[0] = scale;
    state[1] = inv_scale;
    state[2] = tracker;
}
