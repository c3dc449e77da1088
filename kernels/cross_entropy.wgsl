// cross_entropy.wgsl — cross-entropy of each row and its gradient, one
// workgroup per row (model only; the CPU side is in mamba_ext/cpu/model.pyx).
// The mean over rows is taken on the host in float64 from the per-row losses.
// common.wgsl is prepended by the loader.
//
// Size letters: M = B*L rows, V vocab.
//
// cross_entropy_forward_backward bindings:
// | binding | name    | shape  | access                                       |
// |---------|---------|--------|----------------------------------------------|
// | 0       | p       | Params | uniform (scale = 1/M: the mean's factor in dlogits, times |
// |         |         |        | the loss scale: given, or loss_scale[0] when use_state)   |
// | 1       | logits  | (M, V) | read                                         |
// | 2       | targets | (M,)   | read (u32 ids, validated on the host)        |
// | 3       | dlogits | (M, V) | read_write: (softmax - onehot) * scale        |
// | 4       | losses  | (M,)   | read_write: logsumexp(logits_r) - logits_r[target_r] |
// | 5       | loss_scale | (4,) | read: mixed precision's loss scale kept on the GPU     |
// |         |         |        | (kernels/amp.wgsl, amp_update_scale), used when use_state |

struct Params { M: u32, V: u32, scale: f32, use_state: u32 }

override WG: u32 = 128u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> dlogits: array<f32>;
@group(0) @binding(4) var<storage, read_write> losses: array<f32>;
@group(0) @binding(5) var<storage, read> loss_scale: array<f32>;

// #include block_reduce.wgsl

@compute @workgroup_size(WG)
fn cross_entropy_forward_backward(@builtin(local_invocation_index) li: u32,
                                  @builtin(workgroup_id) wid: vec3<u32>,
                                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;
    let valid = r < p.M;
    let base = r * p.V;
    var mx = -3.4e38;
    if (valid) { for (var j = li; j < p.V; j += WG) { mx = max(mx, logits[base + j]); } }
    mx = block_reduce(li, mx, true);
    var se = 0.0;
    if (valid) { for (var j = li; j < p.V; j += WG) { se += exp(logits[base + j] - mx); } }
    se = block_reduce(li, se, false);
    if (!valid) { return; }
    let tgt = targets[r];
    let scale = p.scale * select(1.0, loss_scale[0], p.use_state == 1u);
    for (var j = li; j < p.V; j += WG) {
        var g = exp(logits[base + j] - mx) / se;
        if (j == tgt) { g -= 1.0; }
        dlogits[base + j] = g * scale;
    }
    if (li == 0u) { losses[r] = log(se) + mx - logits[base + tgt]; }
}
