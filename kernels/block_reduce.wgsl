// block_reduce.wgsl — fixed-order workgroup tree reduction, included (not
// dispatched) by kernels that reduce one row per workgroup: rmsnorm, cross_entropy.
// Use: a line `// #include block_reduce.wgsl` in the including file, which must
// declare `override WG` (the workgroup size; any value, not only powers of two).
// Size letters: WG invocations per workgroup.
//
// Bindings: none.

var<workgroup> red: array<f32, WG>;   // red (WG,) scratch of the reduction

// Sum (is_max false) or max (is_max true) of v over the workgroup, in a fixed
// order (deterministic); every invocation gets the result. Must be reached by
// every invocation of the workgroup (it holds barriers).
fn block_reduce(li: u32, v: f32, is_max: bool) -> f32 {
    red[li] = v;
    workgroupBarrier();
    // WG is not required to be a power of two: fold the tail first.
    var n = WG;
    loop {
        if (n <= 1u) { break; }
        let half = (n + 1u) / 2u;
        if (li < n - half) {
            if (is_max) { red[li] = max(red[li], red[li + half]); }
            else { red[li] = red[li] + red[li + half]; }
        }
        workgroupBarrier();
        n = half;
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}
