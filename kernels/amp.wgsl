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
//                      gradient norm's non-finite count sees it)
//
// Bindings (one invocation per element):
// | entry             | binding: name shape access                                |
// |-------------------|-----------------------------------------------------------|
// | amp_round_weights | 0 p Params uniform; 1 w (n) r; 2 w16 (n) rw               |
// | amp_round_grads   | 0 p Params uniform; 2 g (n) rw                            |

struct Params { n: u32, inv_scale: f32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

fn round_f16(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let sign = b & 0x80000000u;
    let a = b & 0x7fffffffu;
    if (a >= 0x7f800000u) { return x; }                               // inf, NaN
    if (a >= 0x477ff000u) { return bitcast<f32>(sign | 0x7f800000u); } // >= 65520: inf
    if (a >= 0x38800000u) {
        // float16 normal range: keep 10 mantissa bits, round half to even at bit 13
        let r = (a + 0xfffu + ((a >> 13u) & 1u)) & 0xffffe000u;
        return bitcast<f32>(sign | r);
    }
    // float16 subnormals: multiples of 2^-24 (round() is half to even; both scalings
    // by powers of two are exact)
    let q = round(bitcast<f32>(a) * 16777216.0) / 16777216.0;
    return bitcast<f32>(sign | bitcast<u32>(q));
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
    out[i] = round_f16(out[i]) * p.inv_scale;
}
