// Generated from nnscaler's op tables by `nnscaler-opt --print-irdl`; do not edit.
// Check IR with: mlir-opt-19 --irdl-file=THIS_FILE input.mlir
irdl.dialect @dnn {
  // Matrix product with optional batch dims and transposed operands
  irdl.operation @matmul {
    %lhs = irdl.base "!builtin.tensor"
    %rhs = irdl.base "!builtin.tensor"
    irdl.operands(%lhs, %rhs)
    %r_out = irdl.base "!builtin.tensor"
    irdl.results(%r_out)
  }
  // x @ weight^T (+ bias), weight stored [out, in] as in PyTorch
  irdl.operation @linear {
    %x = irdl.base "!builtin.tensor"
    %weight = irdl.base "!builtin.tensor"
    %bias = irdl.base "!builtin.tensor"
    irdl.operands(%x, %weight, optional %bias)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Elementwise sum with broadcasting
  irdl.operation @add {
    %lhs = irdl.base "!builtin.tensor"
    %rhs = irdl.base "!builtin.tensor"
    irdl.operands(%lhs, %rhs)
    %r_out = irdl.base "!builtin.tensor"
    irdl.results(%r_out)
  }
  // Elementwise difference with broadcasting
  irdl.operation @sub {
    %lhs = irdl.base "!builtin.tensor"
    %rhs = irdl.base "!builtin.tensor"
    irdl.operands(%lhs, %rhs)
    %r_out = irdl.base "!builtin.tensor"
    irdl.results(%r_out)
  }
  // Elementwise product with broadcasting
  irdl.operation @mul {
    %lhs = irdl.base "!builtin.tensor"
    %rhs = irdl.base "!builtin.tensor"
    irdl.operands(%lhs, %rhs)
    %r_out = irdl.base "!builtin.tensor"
    irdl.results(%r_out)
  }
  // Elementwise quotient with broadcasting
  irdl.operation @div {
    %lhs = irdl.base "!builtin.tensor"
    %rhs = irdl.base "!builtin.tensor"
    irdl.operands(%lhs, %rhs)
    %r_out = irdl.base "!builtin.tensor"
    irdl.results(%r_out)
  }
  // -x
  irdl.operation @neg {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // |x|
  irdl.operation @abs {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // e^x
  irdl.operation @exp {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Natural logarithm
  irdl.operation @log {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Square root
  irdl.operation @sqrt {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // 1 / sqrt(x)
  irdl.operation @rsqrt {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // 1 / (1 + e^-x)
  irdl.operation @sigmoid {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Hyperbolic tangent
  irdl.operation @tanh {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Gaussian error linear unit
  irdl.operation @gelu {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Converts floats to another float type: to bf16 rounds to nearest (ties to even), to f32 is exact; what --autocast inserts around matrix products
  irdl.operation @cast {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_to = irdl.base "#builtin.string"
    irdl.attributes {"to" = %a_to}
  }
  // x * sigmoid(x)
  irdl.operation @silu {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // max(x, 0)
  irdl.operation @relu {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Softmax along one dimension
  irdl.operation @softmax {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Log of softmax along one dimension
  irdl.operation @log_softmax {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Layer normalization over the last dimension, with weight and bias
  irdl.operation @layer_norm {
    %x = irdl.base "!builtin.tensor"
    %weight = irdl.base "!builtin.tensor"
    %bias = irdl.base "!builtin.tensor"
    irdl.operands(%x, %weight, %bias)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // RMS normalization over the last dimension, with weight
  irdl.operation @rms_norm {
    %x = irdl.base "!builtin.tensor"
    %weight = irdl.base "!builtin.tensor"
    irdl.operands(%x, %weight)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Rows of a table selected by integer ids
  irdl.operation @embedding {
    %ids = irdl.base "!builtin.tensor"
    %table = irdl.base "!builtin.tensor"
    irdl.operands(%ids, %table)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Same elements, new shape
  irdl.operation @reshape {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_shape_d = irdl.base "#builtin.dense_array"
    %a_shape_a = irdl.base "#builtin.array"
    %a_shape = irdl.any_of(%a_shape_d, %a_shape_a)
    irdl.attributes {"shape" = %a_shape}
  }
  // Permutes dimensions: result dim i is operand dim perm[i]
  irdl.operation @transpose {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_perm_d = irdl.base "#builtin.dense_array"
    %a_perm_a = irdl.base "#builtin.array"
    %a_perm = irdl.any_of(%a_perm_d, %a_perm_a)
    irdl.attributes {"perm" = %a_perm}
  }
  // The range [start, end) of one dimension
  irdl.operation @slice {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_dim = irdl.base "#builtin.integer"
    %a_start = irdl.base "#builtin.integer"
    %a_end = irdl.base "#builtin.integer"
    irdl.attributes {"dim" = %a_dim, "start" = %a_start, "end" = %a_end}
  }
  // Joins tensors along one dimension
  irdl.operation @concat {
    %inputs = irdl.base "!builtin.tensor"
    irdl.operands(variadic %inputs)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_dim = irdl.base "#builtin.integer"
    irdl.attributes {"dim" = %a_dim}
  }
  // Cuts one dimension into consecutive pieces
  irdl.operation @split {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_pieces = irdl.base "!builtin.tensor"
    irdl.results(variadic %r_pieces)
    %a_dim = irdl.base "#builtin.integer"
    %a_sizes_d = irdl.base "#builtin.dense_array"
    %a_sizes_a = irdl.base "#builtin.array"
    %a_sizes = irdl.any_of(%a_sizes_d, %a_sizes_a)
    irdl.attributes {"dim" = %a_dim, "sizes" = %a_sizes}
  }
  // Sum over dimensions
  irdl.operation @sum {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_dims_d = irdl.base "#builtin.dense_array"
    %a_dims_a = irdl.base "#builtin.array"
    %a_dims = irdl.any_of(%a_dims_d, %a_dims_a)
    irdl.attributes {"dims" = %a_dims}
  }
  // Mean over dimensions
  irdl.operation @mean {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_dims_d = irdl.base "#builtin.dense_array"
    %a_dims_a = irdl.base "#builtin.array"
    %a_dims = irdl.any_of(%a_dims_d, %a_dims_a)
    irdl.attributes {"dims" = %a_dims}
  }
  // Maximum over dimensions
  irdl.operation @max {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_dims_d = irdl.base "#builtin.dense_array"
    %a_dims_a = irdl.base "#builtin.array"
    %a_dims = irdl.any_of(%a_dims_d, %a_dims_a)
    irdl.attributes {"dims" = %a_dims}
  }
  // Scaled dot-product attention over [b, h, s, d]; grouped-query when k/v have fewer heads
  irdl.operation @attention {
    %q = irdl.base "!builtin.tensor"
    %k = irdl.base "!builtin.tensor"
    %v = irdl.base "!builtin.tensor"
    irdl.operands(%q, %k, %v)
    %r_out = irdl.base "!builtin.tensor"
    irdl.results(%r_out)
  }
  // Rotary position embedding of [b, h, s, d] (rotate-half form)
  irdl.operation @rotary {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Mean cross-entropy of [tokens.., vocab] logits (one or more token dims) against integer targets of the token shape
  irdl.operation @cross_entropy {
    %logits = irdl.base "!builtin.tensor"
    %targets = irdl.base "!builtin.tensor"
    irdl.operands(%logits, %targets)
    %r_loss = irdl.base "!builtin.tensor"
    irdl.results(%r_loss)
  }
  // logits[.., targets[..]] for every token of [tokens.., classes] logits (the target logit of cross-entropy); on a class shard, tokens whose target lies elsewhere give 0
  irdl.operation @pick {
    %logits = irdl.base "!builtin.tensor"
    %targets = irdl.base "!builtin.tensor"
    irdl.operands(%logits, %targets)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
  }
  // Zeroes elements with probability p and scales the rest by 1/(1-p); the mask is a function of (seed, element index), and of the training step when the optional scalar step is given (a new mask each step)
  irdl.operation @dropout {
    %x = irdl.base "!builtin.tensor"
    %step = irdl.base "!builtin.tensor"
    irdl.operands(%x, optional %step)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_p_f = irdl.base "#builtin.float"
    %a_p_i = irdl.base "#builtin.integer"
    %a_p = irdl.any_of(%a_p_f, %a_p_i)
    %a_seed = irdl.base "#builtin.integer"
    irdl.attributes {"p" = %a_p, "seed" = %a_seed}
  }
  // A tensor with every element equal to value
  irdl.operation @fill {
    irdl.operands()
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_shape_d = irdl.base "#builtin.dense_array"
    %a_shape_a = irdl.base "#builtin.array"
    %a_shape = irdl.any_of(%a_shape_d, %a_shape_a)
    %a_value_f = irdl.base "#builtin.float"
    %a_value_i = irdl.base "#builtin.integer"
    %a_value = irdl.any_of(%a_value_f, %a_value_i)
    irdl.attributes {"shape" = %a_shape, "value" = %a_value}
  }
  // One AdamW step (torch.optim.AdamW) on the gradient times scale (clipping's factor; default 1): decoupled weight decay, moments, bias-corrected update; lr, step (from 1) and scale are scalars
  irdl.operation @adamw {
    %param = irdl.base "!builtin.tensor"
    %grad = irdl.base "!builtin.tensor"
    %m = irdl.base "!builtin.tensor"
    %v = irdl.base "!builtin.tensor"
    %lr = irdl.base "!builtin.tensor"
    %step = irdl.base "!builtin.tensor"
    %scale = irdl.base "!builtin.tensor"
    irdl.operands(%param, %grad, %m, %v, %lr, %step, optional %scale)
    %r_param = irdl.base "!builtin.tensor"
    %r_m = irdl.base "!builtin.tensor"
    %r_v = irdl.base "!builtin.tensor"
    irdl.results(%r_param, %r_m, %r_v)
    %a_beta1_f = irdl.base "#builtin.float"
    %a_beta1_i = irdl.base "#builtin.integer"
    %a_beta1 = irdl.any_of(%a_beta1_f, %a_beta1_i)
    %a_beta2_f = irdl.base "#builtin.float"
    %a_beta2_i = irdl.base "#builtin.integer"
    %a_beta2 = irdl.any_of(%a_beta2_f, %a_beta2_i)
    %a_eps_f = irdl.base "#builtin.float"
    %a_eps_i = irdl.base "#builtin.integer"
    %a_eps = irdl.any_of(%a_eps_f, %a_eps_i)
    %a_weight_decay_f = irdl.base "#builtin.float"
    %a_weight_decay_i = irdl.base "#builtin.integer"
    %a_weight_decay = irdl.any_of(%a_weight_decay_f, %a_weight_decay_i)
    irdl.attributes {"beta1" = %a_beta1, "beta2" = %a_beta2, "eps" = %a_eps, "weight_decay" = %a_weight_decay}
  }
  // Gradient clipping's factor (torch clip_grad_norm_): min(1, max_norm / (sqrt(sumsq) + 1e-6)) of the gradients' summed squares
  irdl.operation @clip_scale {
    %sumsq = irdl.base "!builtin.tensor"
    irdl.operands(%sumsq)
    %r_scale = irdl.base "!builtin.tensor"
    irdl.results(%r_scale)
    %a_max_norm_f = irdl.base "#builtin.float"
    %a_max_norm_i = irdl.base "#builtin.integer"
    %a_max_norm = irdl.any_of(%a_max_norm_f, %a_max_norm_i)
    irdl.attributes {"max_norm" = %a_max_norm}
  }
  // dy * gelu'(x)
  irdl.operation @gelu_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // dy * silu'(x)
  irdl.operation @silu_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // dy where x > 0, else 0
  irdl.operation @relu_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // dy * (1 - y^2), given the forward output y
  irdl.operation @tanh_grad {
    %dy = irdl.base "!builtin.tensor"
    %y = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %y)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // Softmax backward, given the forward output y
  irdl.operation @softmax_grad {
    %dy = irdl.base "!builtin.tensor"
    %y = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %y)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // Log-softmax backward, given the forward output y
  irdl.operation @log_softmax_grad {
    %dy = irdl.base "!builtin.tensor"
    %y = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %y)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // Layer-norm backward: dx, dweight, dbias
  irdl.operation @layer_norm_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    %weight = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x, %weight)
    %r_dx = irdl.base "!builtin.tensor"
    %r_dweight = irdl.base "!builtin.tensor"
    %r_dbias = irdl.base "!builtin.tensor"
    irdl.results(%r_dx, %r_dweight, %r_dbias)
  }
  // RMS-norm backward: dx, dweight
  irdl.operation @rms_norm_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    %weight = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x, %weight)
    %r_dx = irdl.base "!builtin.tensor"
    %r_dweight = irdl.base "!builtin.tensor"
    irdl.results(%r_dx, %r_dweight)
  }
  // Scatter-adds dy rows into a [vocab, e] table gradient
  irdl.operation @embedding_grad {
    %dy = irdl.base "!builtin.tensor"
    %ids = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %ids)
    %r_dtable = irdl.base "!builtin.tensor"
    irdl.results(%r_dtable)
    %a_vocab = irdl.base "#builtin.integer"
    irdl.attributes {"vocab" = %a_vocab}
  }
  // Linear backward for the weight: dy^T x summed over the leading dims, [out, in]
  irdl.operation @linear_weight_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x)
    %r_dweight = irdl.base "!builtin.tensor"
    irdl.results(%r_dweight)
  }
  // Attention backward (recomputes scores): dq, dk, dv
  irdl.operation @attention_grad {
    %dout = irdl.base "!builtin.tensor"
    %q = irdl.base "!builtin.tensor"
    %k = irdl.base "!builtin.tensor"
    %v = irdl.base "!builtin.tensor"
    irdl.operands(%dout, %q, %k, %v)
    %r_dq = irdl.base "!builtin.tensor"
    %r_dk = irdl.base "!builtin.tensor"
    %r_dv = irdl.base "!builtin.tensor"
    irdl.results(%r_dq, %r_dk, %r_dv)
  }
  // Rotary embedding backward (the inverse rotation)
  irdl.operation @rotary_grad {
    %dy = irdl.base "!builtin.tensor"
    irdl.operands(%dy)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
  }
  // Cross-entropy backward: dloss * (softmax(logits) - onehot(targets)) / tokens
  irdl.operation @cross_entropy_grad {
    %dloss = irdl.base "!builtin.tensor"
    %logits = irdl.base "!builtin.tensor"
    %targets = irdl.base "!builtin.tensor"
    irdl.operands(%dloss, %logits, %targets)
    %r_dlogits = irdl.base "!builtin.tensor"
    irdl.results(%r_dlogits)
  }
  // Scatters dy[..] into class targets[..] of each token of a [tokens.., classes] zero tensor
  irdl.operation @pick_grad {
    %dy = irdl.base "!builtin.tensor"
    %targets = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %targets)
    %r_dlogits = irdl.base "!builtin.tensor"
    irdl.results(%r_dlogits)
    %a_classes = irdl.base "#builtin.integer"
    irdl.attributes {"classes" = %a_classes}
  }
  // Cross-entropy backward from a known log-sum-exp: dloss * (exp(logits - lse) - onehot(targets)) / count; runs on a class shard (vocabulary parallelism)
  irdl.operation @softmax_xent_grad {
    %dloss = irdl.base "!builtin.tensor"
    %logits = irdl.base "!builtin.tensor"
    %targets = irdl.base "!builtin.tensor"
    %lse = irdl.base "!builtin.tensor"
    irdl.operands(%dloss, %logits, %targets, %lse)
    %r_dlogits = irdl.base "!builtin.tensor"
    irdl.results(%r_dlogits)
  }
  // Repeats a tensor to a larger shape (numpy broadcasting); the backward of sum/mean
  irdl.operation @broadcast_to {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_shape_d = irdl.base "#builtin.dense_array"
    %a_shape_a = irdl.base "#builtin.array"
    %a_shape = irdl.any_of(%a_shape_d, %a_shape_a)
    irdl.attributes {"shape" = %a_shape}
  }
  // Routes dy to the positions of the maximum of x
  irdl.operation @max_grad {
    %dy = irdl.base "!builtin.tensor"
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%dy, %x)
    %r_dx = irdl.base "!builtin.tensor"
    irdl.results(%r_dx)
    %a_dims_d = irdl.base "#builtin.dense_array"
    %a_dims_a = irdl.base "#builtin.array"
    %a_dims = irdl.any_of(%a_dims_d, %a_dims_a)
    irdl.attributes {"dims" = %a_dims}
  }
  // Zero-pads one dimension; the backward of slice
  irdl.operation @pad {
    %x = irdl.base "!builtin.tensor"
    irdl.operands(%x)
    %r_y = irdl.base "!builtin.tensor"
    irdl.results(%r_y)
    %a_dim = irdl.base "#builtin.integer"
    %a_before = irdl.base "#builtin.integer"
    %a_after = irdl.base "#builtin.integer"
    irdl.attributes {"dim" = %a_dim, "before" = %a_before, "after" = %a_after}
  }
}
