// common.wgsl — scalar helpers shared by every kernel file (the GPU side of
// mamba_ext/cpu/activations.pxd). WGSL has no #include, so the loader
// (mamba_ext/gpu/device.py, kernel_source) prepends this file to each kernel
// file before compiling it.
//
// Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
// R dtRank, P = R + 2N, M = B*L rows, V vocab, C = ceil(L / SCAN_CHUNK) scan chunks.
//
// Bindings: none.

// Flat index of an invocation in a 1-D problem dispatched as a 2-D grid of
// workgroups (x, y): the grid is split in y when x would exceed the adapter's
// max workgroups per dimension.
fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, wg: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * wg + lid;
}

// Overflow-free logistic function.
fn sigmoid(x: f32) -> f32 {
    if (x >= 0.0) {
        return 1.0 / (1.0 + exp(-x));
    }
    let e = exp(x);
    return e / (1.0 + e);
}

fn silu(x: f32) -> f32 { return x * sigmoid(x); }

// d silu / dx = s * (1 + x * (1 - s)).
fn dsilu(x: f32) -> f32 {
    let s = sigmoid(x);
    return s * (1.0 + x * (1.0 - s));
}

// exp(x) - 1 without the cancellation of exp(x) - 1 near 0 (WGSL has no expm1), four at
// a time, for x <= 0 (every caller's x is delta * A, delta >= 0 > A); ex = exp(x), already
// computed by every caller that has it. -0.5 < x <= 0: x times a degree-5 polynomial fitted
// to expm1(x)/x on [-0.5, 0] for relative error (fit 1.4e-9, 5.4e-8 evaluated in float32,
// under float32's half ulp); otherwise |exp(x) - 1| > 0.39 and the subtraction loses
// nothing, except for 0 < x < 0.5, outside the domain, where it does. Fitted on the domain
// alone, it takes two fma fewer than a Taylor series as accurate: the scan kernels evaluate
// it up to three times per (b, t, d, n), and their backward is bound by its instructions.
fn expm1_v4(x: vec4<f32>, ex: vec4<f32>) -> vec4<f32> {
    var s = vec4<f32>(0.0011216342682018876);
    s = fma(s, x, vec4<f32>(0.00818738341331482));
    s = fma(s, x, vec4<f32>(0.041629087179899216));
    s = fma(s, x, vec4<f32>(0.16666224598884583));
    s = fma(s, x, vec4<f32>(0.4999998211860657));
    s = fma(s, x, vec4<f32>(1.0));
    return select(ex - 1.0, s * x, series_range(x));
}

// Where expm1_v4 takes its series: -0.5 < x <= 0.
fn series_range(x: vec4<f32>) -> vec4<bool> {
    return (x > vec4<f32>(-0.5)) & (x <= vec4<f32>(0.0));
}

fn expm1_f(x: f32) -> f32 { return expm1_v4(vec4<f32>(x), vec4<f32>(exp(x))).x; }

// log(1 + e) for e >= 0 (WGSL has no log1p; GPU log is only absolutely accurate
// near 1). e < 0.1: alternating series to e^9 (truncation < 1e-10 relative).
fn log1p_pos(e: f32) -> f32 {
    if (e < 0.1) {
        var s = 1.0 / 9.0;
        s = s * e - 1.0 / 8.0;
        s = s * e + 1.0 / 7.0;
        s = s * e - 1.0 / 6.0;
        s = s * e + 1.0 / 5.0;
        s = s * e - 1.0 / 4.0;
        s = s * e + 1.0 / 3.0;
        s = s * e - 0.5;
        s = s * e + 1.0;
        return s * e;
    }
    return log(1.0 + e);
}

// softplus(x) = max(x, 0) + log1p(exp(-|x|)).
fn softplus(x: f32) -> f32 { return max(x, 0.0) + log1p_pos(exp(-abs(x))); }

// True for +-inf and NaN (WGSL has no isfinite).
fn not_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// The f32 value of the float16 bits h (the low 16 bits), exactly: every f16 value is an
// f32; subnormals decoded here (unpack2x16float may flush them). act_value (the f16 mode's
// cache), amp.wgsl's rounding and the reference f16 product read f16 values through it.
fn f16_value(h : u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {                                   // zero, subnormal: m * 2^-24
        return bitcast<f32>(sign | bitcast<u32>(f32(m) * (1.0 / 16777216.0)));
    }
    if (e == 31u) { return bitcast<f32>(sign | 0x7f800000u | (m << 13u)); }   // inf, NaN
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// the float16 bits of x rounded to nearest, ties to even, in one step (as NumPy's
// npy_floatbits_to_halfbits: a rounding that carries out of the mantissa lands in the next
// binade, or in inf); amp.wgsl's round_f16 is their value; the f16
// copies of activations (amp.wgsl, activations.wgsl) are formed from them
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a >= 0x477ff000u) {                                   // >= 65520 (to inf), inf, NaN
        return sign | select(0x7c00u, 0x7e00u, a > 0x7f800000u);
    }
    if (a >= 0x38800000u) {                                   // normal: round half to even at
        return sign | ((a + 0xfffu + ((a >> 13u) & 1u) - 0x38000000u) >> 13u);   // bit 13, rebias
    }
    return sign | u32(round(bitcast<f32>(a) * 16777216.0));   // subnormal: units of 2^-24
}

// One word of an f16 copy: elements 2j (lower half) and 2j + 1 (upper), act_value's layout.
fn f16_pair(x0: f32, x1: f32) -> u32 { return f16_bits(x0) | (f16_bits(x1) << 16u); }

// Element e of an activation buffer held as f32 words or, with ``half``, as f16 pairs (two
// per word, element e in half e % 2: the f16 mode's cache, read where it is used instead
// of unpacked into an f32 copy): act_value(buf[act_word(e, half)], e, half).
fn act_word(e: u32, half: bool) -> u32 { return select(e, e / 2u, half); }

fn act_value(w: u32, e: u32, half: bool) -> f32 {
    if (half) { return f16_value(select(w & 0xffffu, w >> 16u, (e & 1u) == 1u)); }
    return bitcast<f32>(w);
}
