// linear_split.wgsl — the operands of an fp32 product run as three f16 products on tensor
// cores (mamba_ext/gpu/linear_split.py; cf. Ootomo & Yokota 2022): each f32 operand X,
// scaled by a power of two s so that its largest |x| lies in [2^14, 2^15), is split into
// an f16 high part and the f16 rounding of what that leaves,
//
//   hi = f16(s x),   lo = f16(s x - hi)        (s x - hi exact in f32),
//
// so that s x = hi + lo to ~22 bits, and the product A B becomes
// (A_hi B_hi + A_hi B_lo + A_lo B_hi) / (sA sB) (the dropped A_lo B_lo is 2^-22 of it):
// kernels/linear_f16.wgsl with SCALED runs it as one product of contraction 3K whose k
// steps read the segments (hi, hi, lo) of A and (hi, lo, hi) of B, from zero or from the
// bias times sA sB, its result times 1/sA 1/sB (all exact powers of two).
//
//   linear_split_absmax: the largest |x| bits of each workgroup's share of the source
//       into its part, sc[2 SLOTS + slot NP_MAX + workgroup] (u32 bits of |x|: NaN above
//       inf above every finite value); NP workgroups striding over the source's runs (its
//       rows when CS1, else its columns), 4 floats a load (VEC4)
//   linear_split_pack: the two planes, hi and lo, each (R, C) f16 row-major from word
//       dst_off (lo after hi: plane words apart), through a 64 x 64 tile of workgroup
//       memory so that the source is read along its contiguous dimension and the planes
//       written along theirs; every workgroup first reduces the NP parts to s (workgroup
//       (0, 0) stores s and 1/s in sc[2 slot], sc[2 slot + 1] for the products)
//
// s = 2^clamp(14 - e, -126, 126) for the largest |x| in [2^e, 2^(e+1)) (s and 1/s normal
// floats); 1 where that is 0, inf or NaN (then lo = 0 where hi is not finite, and a NaN or
// inf still reaches the product's rows and columns that read it).
//
// Size letters: R rows, C columns of the source block (multiples of 64: checked on the
// host), element (r, c) of the source at x[off + r*rs + c*cs] (cs 1 when CS1, else rs 1).
//
// Bindings:
// | binding | name | shape                                           | access     |
// |---------|------|-------------------------------------------------|------------|
// | 0       | p    | Params                                          | uniform    |
// | 1       | x4   | the f32 source, as vec4 (one entry point: both) | read       |
// | 2       | dst  | the planes hi, lo: 2 (R, C) f16, 2 per u32      | read_write |
// | 3       | sc   | u32: (s, 1/s) f32 bits per slot, then each      | read_write |
// |         |      | slot's NP_MAX parts                             |            |

struct Params { rows: u32, cols: u32, off: u32, rs: u32, cs: u32, dst_off: u32,
                plane: u32, slot: u32, np: u32 }

override CS1: bool = true;        // the source's columns are contiguous (cs 1), else its rows
override VEC4: bool = false;      // runs, offset and stride multiples of 4 (vec4 loads)
override SLOTS: u32 = 4u;         // scale slots before the parts
override NP_MAX: u32 = 1024u;     // parts per slot
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
@group(0) @binding(3) var<storage, read_write> sc: array<u32>;

var<workgroup> red: array<u32, 256>;             // a workgroup's maxima, reduced in halves
var<workgroup> tile: array<f32, 64u * 65u>;      // (64, 64) of the source, rows 65 apart

// the largest of the 256 invocations' v (every invocation gets it)
fn workgroup_max(t: u32, v: u32) -> u32 {
    red[t] = v;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h /= 2u) {
        if (t < h) { red[t] = max(red[t], red[t + h]); }
        workgroupBarrier();
    }
    let m = red[0];
    workgroupBarrier();
    return m;
}

fn abs_bits(v: f32) -> u32 { return bitcast<u32>(v) & 0x7fffffffu; }

// float `at` of the source (x4 holds it as vec4: one binding serves both widths of load)
fn x(at: u32) -> f32 { return x4[at / 4u][at % 4u]; }

@compute @workgroup_size(256)
fn linear_split_absmax(@builtin(local_invocation_index) t: u32,
                       @builtin(workgroup_id) wid: vec3<u32>) {
    // the source as runs along its contiguous dimension, `stride` apart
    let len = select(p.rows, p.cols, CS1);
    let stride = select(p.cs, p.rs, CS1);
    let q = select(1u, 4u, VEC4);                  // floats a load
    let per_run = len / q;
    let n = p.rows * p.cols / q;
    var m = 0u;
    for (var e = wid.x * 256u + t; e < n; e += p.np * 256u) {
        let at = p.off + (e / per_run) * stride + (e % per_run) * q;
        if (VEC4) {
            let v = x4[at / 4u];
            m = max(m, max(max(abs_bits(v.x), abs_bits(v.y)), max(abs_bits(v.z), abs_bits(v.w))));
        } else {
            m = max(m, abs_bits(x(at)));
        }
    }
    m = workgroup_max(t, m);
    if (t == 0u) { sc[2u * SLOTS + p.slot * NP_MAX + wid.x] = m; }
}

@compute @workgroup_size(256)
fn linear_split_pack(@builtin(local_invocation_index) t: u32,
                     @builtin(workgroup_id) wid: vec3<u32>) {
    // s from the NP parts of linear_split_absmax
    var m = 0u;
    for (var i = t; i < p.np; i += 256u) { m = max(m, sc[2u * SLOTS + p.slot * NP_MAX + i]); }
    m = workgroup_max(t, m);
    var se = 0i;                                   // s = 2^se
    if (m != 0u && m < 0x7f800000u) { se = clamp(14i - (i32(m >> 23u) - 127i), -126i, 126i); }
    let s = bitcast<f32>(u32(se + 127i) << 23u);
    if (t == 0u && wid.x == 0u && wid.y == 0u) {
        sc[2u * p.slot] = bitcast<u32>(s);
        sc[2u * p.slot + 1u] = u32(127i - se) << 23u;   // 1/s, exactly
    }
    // this workgroup's 64 x 64 block of the source, read along its contiguous dimension
    // (16 loads of one float, or 4 of four, an invocation)
    let r0 = wid.y * 64u;
    let c0 = wid.x * 64u;
    if (VEC4) {
        for (var q = 0u; q < 4u; q++) {
            let e = t + 256u * q;
            let a = e / 16u;                       // the run (row, or column) in the block
            let b = (e % 16u) * 4u;                // its first of 4
            if (CS1) {
                let v = x4[(p.off + (r0 + a) * p.rs + c0 + b) / 4u];
                for (var k = 0u; k < 4u; k++) { tile[a * 65u + b + k] = v[k]; }
            } else {
                let v = x4[(p.off + (c0 + a) * p.cs + r0 + b) / 4u];
                for (var k = 0u; k < 4u; k++) { tile[(b + k) * 65u + a] = v[k]; }
            }
        }
    } else {
        for (var q = 0u; q < 16u; q++) {
            let e = t + 256u * q;
            var r = e / 64u;
            var c = e % 64u;
            if (!CS1) { r = e % 64u; c = e / 64u; }
            tile[r * 65u + c] = x(p.off + (r0 + r) * p.rs + (c0 + c) * p.cs);
        }
    }
    workgroupBarrier();
    // word w: columns 2j, 2j + 1 of row r, into both planes
    for (var q = 0u; q < 8u; q++) {
        let w = t + 256u * q;
        let r = w / 32u;
        let j = w % 32u;
        var hi = 0u;
        var lo = 0u;
        for (var h = 0u; h < 2u; h++) {
            let v = s * tile[r * 65u + 2u * j + h];
            let hb = f16_bits(v);
            var lb = 0u;
            if ((hb & 0x7c00u) != 0x7c00u) { lb = f16_bits(v - f16_value(hb)); }
            hi |= hb << (16u * h);
            lo |= lb << (16u * h);
        }
        let at = p.dst_off + (r0 + r) * (p.cols / 2u) + (c0 + 2u * j) / 2u;
        dst[at] = hi;
        dst[at + p.plane] = lo;
    }
}
