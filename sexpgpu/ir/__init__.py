"""The IR: one frozen node type, a closed op set, rule tables, autodiff, passes.

Modules
-------
``ops``
    `Op` (the closed op set) and its groups: LEAF, FED, UNARY, BINARY, COMPARISON,
    ELEMENTWISE, REDUCE, MOVEMENT, VIEW, PRODUCT, FUSED.
``dtypes``
    `DType` (f32, bf16, f64, int32, bool), `FLOATS`, `numpy_dtype`, `round_bf16`.
``node``
    `Node(op, dtype, shape, inputs, attrs, span)` (frozen, compared by
    identity), `ConstArray`, `Graph(inputs, params, outputs)` with `Graph.of`.
``rules``
    The tables SHAPE_RULES, IMPL_RULES, VJP_RULES keyed by `Op` and their
    decorators; ``shape_rules``, ``numpy_impl`` (+ ``numpy_fused``) and
    ``vjp_rules`` fill them. ``numpy_impl.evaluate(node, *arrays, out=None)``
    runs one node (rounding bf16 results).
``builder``
    One function per op, each running the op's shape rule:

    - leaves: ``input(name, shape, dtype)``, ``param(name, shape, dtype)``,
      ``constant(value, dtype, shape=())`` (a scalar broadcasts),
      ``iota(shape, axis, dtype="int32")``;
    - elementwise: ``neg exp log sqrt rsqrt tanh sigmoid abs sign``,
      ``cast(x, dtype)``, ``add sub mul div pow maximum minimum`` and
      ``lt le gt ge eq`` (NumPy broadcasting; operands of one dtype),
      ``where(cond, a, b)``;
    - reductions: ``sum(x, axes=None, keepdims=False)``, ``max(...)``;
    - movement: ``reshape(x, shape)`` (one -1 allowed), ``transpose(x, axes=None)``
      (default: swap the last two), ``broadcast_to(x, shape)``,
      ``slice(x, axis, start, stop)``, ``pad(x, axis, before, after)``,
      ``concat(xs, axis)``, ``take(table, ids)``, ``scatter_add(ids, updates, rows)``;
    - products: ``matmul(a, b)`` (last two axes, batch axes broadcast);
    - fused: ``softmax(x, axis=-1)``, ``log_softmax(x, axis=-1)``,
      ``cross_entropy(logits, targets)`` (per row, not averaged),
      ``attention(q, k, v, causal, scale=None)`` (``[... seq dim]`` each),
      ``layernorm(x, eps=1e-5)`` (last axis, no affine), ``gelu(x)`` (tanh
      form), and the gradient ops ``softmax_grad``, ``cross_entropy_grad``,
      ``attention_grad``, ``layernorm_grad``, ``gelu_grad``;
    - generic: ``emit(op, *inputs, span=None, **attrs)``.

    Every function takes ``span=`` (the source form's `Span`); a shape or
    dtype error raises `SexpgpuError` E-SHAPE-001..011 at that span, naming
    the shapes (``matmul: inner dimensions differ, 32 and 7 ([16 32] by [7 3])``).
``autodiff``
    ``grad(loss, wrt, cotangent=None) -> tuple[Node, ...]`` (reverse mode) and
    ``training_graph(forward, loss="loss", prefix="grad/") -> Graph``.
``passes``
    ``cse``, ``fold_constants``, ``dce``, ``optimize(graph, check=None)`` and
    the generic ``rewrite(graph, visit)``.
``verify``
    ``verify(graph)`` raising ``IRError`` with the printed program around the
    bad node.
``printer``
    ``format_graph(graph, spans=True) -> str`` and ``parse_graph(text) -> Graph``.

The interpreter that runs graphs is `sexpgpu.devices.cpu` (``CpuProgram``, ``run``).
"""
