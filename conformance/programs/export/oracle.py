"""The script's model, per-rank batches and single-process oracle, and the checks against the oracle
after each operation.
"""

from __future__ import annotations

import textwrap

from conformance.programs.export.uses import (
    FSDP1,
    FSDP2,
    ZERO,
    Uses,
    block,
    indented,
    optimizer_params,
    uses_ddp_wrapper,
)
from conformance.programs.program import ClipStep, EvalForward, Unshard


# -- model -------------------------------------------------------------------------------------
def model_part(uses: Uses) -> str:
    shape = uses.program.model
    if shape.buffers:
        block_init = [
            "self.linear = nn.Linear(WIDTH, WIDTH)",
            'self.register_buffer("scale", torch.ones(WIDTH))',
        ]
        block_forward = ["y = torch.tanh(self.linear(x))", "y = y * self.scale.to(y.dtype)"]
        block_doc = "tanh(linear(x)) times a buffer, halved in eval mode (a backend that ignores eval() shows)."
    else:
        block_init = ["self.linear = nn.Linear(WIDTH, WIDTH)"]
        block_forward = ["y = torch.tanh(self.linear(x))"]
        block_doc = "tanh(linear(x)), halved in eval mode (a backend that ignores eval() shows)."
    model_init = [
        "self.inp = nn.Linear(IN_WIDTH, WIDTH)",
        "self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])",
        "self.out = nn.Linear(WIDTH, OUT_WIDTH)",
    ]
    if uses.swaps:
        model_init.append("self.swapped = False  # blocks 0 and 1 trade places in the forward")
    for index in shape.frozen:
        model_init.append(f"self.blocks[{index}].linear.requires_grad_(False)  # frozen: block {index} does not train")
    if shape.tied:
        model_init.append("self.blocks[1].linear.weight = self.blocks[0].linear.weight  # tied: one weight, two uses")
    # Activation checkpointing as Hugging Face models apply it: backward runs each block's forward
    # again, its module hooks (a backend's gather) included.
    call = "checkpoint(block, h, use_reentrant=False)" if shape.checkpointed else "block(h)"
    if uses.swaps:
        forward = ["h = self.inp(x)", "for index in self.route():", "    block = self.blocks[index]"]
        forward += [f"    h = {call}", "return self.out(h)"]
        route = block(
            '''
                def route(self) -> list[int]:
                    """The order the blocks run in: blocks 0 and 1 trade places while swapped."""
                    order = list(range(DEPTH))
                    if self.swapped:
                        order[0], order[1] = order[1], order[0]
                    return order
            '''
        )
    else:
        forward = ["h = self.inp(x)", "for block in self.blocks:", f"    h = {call}", "return self.out(h)"]
        route = ""
    buffer_init = ""
    if shape.buffers:
        buffer_init = (
            "\n        for buffer in model.buffers():"
            "\n            buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)"
        )
    text = block(
        '''
        class Block(nn.Module):
            """<<block_doc>>"""

            def __init__(self) -> None:
                super().__init__()
        <<block_init>>

            def forward(self, x: torch.Tensor) -> torch.Tensor:
        <<block_forward>>
                return y if self.training else y * 0.5


        class Model(nn.Module):
            """An input linear, DEPTH square blocks<<checkpoint_words>>, an output linear."""

            def __init__(self) -> None:
                super().__init__()
        <<model_init>>
        <<route>>
            def forward(self, x: torch.Tensor) -> torch.Tensor:
        <<forward>>


        def build_model(seed: int, device: torch.device) -> Model:
            """The model with values drawn from `seed`<<buffer_words>>."""
            generator = torch.Generator().manual_seed(seed)
            with torch.device("cpu"):
                model = Model()
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)<<buffer_init>>
            return model.to(device)
        ''',
        block_doc=block_doc,
        block_init=indented(block_init, 2),
        block_forward=indented(block_forward, 2),
        model_init=indented(model_init, 2),
        route="\n" + textwrap.indent(route, "    ") if route else "",
        forward=indented(forward, 2),
        buffer_init=buffer_init,
        checkpoint_words=" (each called through torch.utils.checkpoint)" if shape.checkpointed else "",
        buffer_words=" (buffers not all ones, so a lost buffer shows)" if shape.buffers else "",
    )
    return text


# -- data --------------------------------------------------------------------------------------
def data_part(uses: Uses) -> str:
    rows = "LOCAL_BATCH + rank" if uses.program.uneven_data else "LOCAL_BATCH"
    return block(
        '''
        def local_batch(iteration: int, rank: int) -> torch.Tensor:
            """What <<data_rank>> `rank` feeds at data iteration `iteration` (on CPU): the generator is seeded
            from (SEED, iteration, rank) alone, so the oracle rebuilds every batch in one process."""
            generator = torch.Generator().manual_seed(hash((SEED, iteration, rank)) & 0x7FFF_FFFF_FFFF_FFFF)
            return torch.randn(<<rows>>, IN_WIDTH, generator=generator)


        def loss_of(output: torch.Tensor) -> torch.Tensor:
            """The sum of the output, in the output's dtype (the compute dtype under mixed precision)."""
            return output.sum()


        def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
            return <<optimizer>>(params, lr=lr)
        <<groups>>''',
        groups=_groups_function(uses),
        optimizer=uses.optimizer_class,
        rows=rows,
        data_rank="data rank" if uses.tensor_parallel else "rank",
    )


def _groups_function(uses: Uses) -> str:
    """The script's parameter groups, where the program has them (the suite's PARAMETER_GROUPS)."""
    if not uses.setup.param_groups:
        return ""
    return "\n\n" + block(
        '''
        def parameter_groups(module: nn.Module) -> list[dict]:
            """Two parameter groups by name, as training scripts build them: weights with weight decay
            WEIGHT_DECAY, biases without (frozen parameters left out)."""
            named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
            groups = [
                {"params": [p for name, p in named if not name.endswith("bias")], "weight_decay": WEIGHT_DECAY},
                {"params": [p for name, p in named if name.endswith("bias")], "weight_decay": 0.0},
            ]
            return [group for group in groups if group["params"]]
        '''
    )


# -- oracle ------------------------------------------------------------------------------------
def oracle_part(uses: Uses) -> str:
    if uses.mixed_precision:
        backward = block(
            '''
            def backward(self, iteration: int) -> list[float]:
                """Every rank's forward + backward of data iteration `iteration`, as mixed precision
                computes them: each rank's batch on a PARAM_DTYPE copy of the float32 parameters, the
                rank gradients summed rank by rank in REDUCTION_DTYPE and divided by WORLD_SIZE, then
                added to the float32 gradients. Returns the rank losses."""
                compute = self.low_precision_copy()
                losses, rank_grads = [], []
                for rank in range(WORLD_SIZE):
                    compute.zero_grad(set_to_none=True)
                    loss = loss_of(compute(local_batch(iteration, rank).to(PARAM_DTYPE)))
                    loss.backward()
                    losses.append(loss.item())
                    rank_grads.append({name: p.grad for name, p in compute.named_parameters() if p.grad is not None})
                with torch.no_grad():
                    for name, master in self.model.named_parameters():
                        if name not in rank_grads[0]:
                            continue
                        total = rank_grads[0][name].to(REDUCTION_DTYPE)
                        for grads in rank_grads[1:]:
                            total = total + grads[name].to(REDUCTION_DTYPE)
                        average = (total / WORLD_SIZE).float()
                        master.grad = average if master.grad is None else master.grad + average
                return losses

            def low_precision_copy(self) -> Model:
                """The model with its parameters in PARAM_DTYPE (buffers stay float32, as the backends keep them)."""
                compute = copy.deepcopy(self.model)
                with torch.no_grad():
                    for param in compute.parameters():
                        param.data = param.data.to(PARAM_DTYPE)
                        param.grad = None
                return compute
            '''
        )
    else:
        backward = block(
            '''
            def backward(self, iteration: int) -> list[float]:
                """One forward over every rank's batch of data iteration `iteration` and a backward of the
                mean rank loss (adds the rank-averaged gradients). Returns the rank losses."""
                x = torch.cat([local_batch(iteration, rank) for rank in range(WORLD_SIZE)])
                chunks = self.model(x)<<split>>
                losses = torch.stack([loss_of(chunk) for chunk in chunks])
                losses.mean().backward()
                return losses.tolist()
            ''',
            split=(
                ".split([LOCAL_BATCH + rank for rank in range(WORLD_SIZE)])"
                if uses.program.uneven_data
                else ".chunk(WORLD_SIZE)"
            ),
        )
    methods = [backward]
    if uses.has(EvalForward):
        compute = "self.low_precision_copy()" if uses.mixed_precision else "self.model"
        cast = ".to(PARAM_DTYPE)" if uses.mixed_precision else ""
        methods.append(
            block(
                '''
                def eval_losses(self, evals: int) -> list[float]:
                    """Every rank's loss of one forward under no_grad (eval forward number `evals`), in the
                    model's current mode."""
                    compute = <<compute>>
                    with torch.no_grad():
                        batches = [local_batch(EVAL_ITERATIONS + evals, rank)<<cast>> for rank in range(WORLD_SIZE)]
                        return [loss_of(compute(x)).item() for x in batches]
                ''',
                compute=compute,
                cast=cast,
            )
        )
    methods.append(
        block(
            """
            def state(self) -> dict[str, torch.Tensor]:
                return {name: value.detach().clone() for name, value in self.model.state_dict().items()}
            """
        )
    )
    if uses.has(ClipStep):
        methods.append(
            block(
                '''
                def clip(self, fraction: float) -> tuple[float, float]:
                    """Clip the gradients to `fraction` x their total norm, as torch does; the norm before
                    and the max_norm clipped to."""
                    params = [p for p in self.model.parameters() if p.grad is not None]
                    norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in params])).item()
                    torch.nn.utils.clip_grad_norm_(params, fraction * norm)
                    return norm, fraction * norm
                '''
            )
        )
    if uses.has(Unshard):
        methods.append(
            block(
                """
                def params(self) -> dict[str, torch.Tensor]:
                    return {name: p.detach().clone() for name, p in self.model.named_parameters()}
                """
            )
        )
    if uses.reads_grads:
        methods.append(
            block(
                """
                def grads(self) -> dict[str, torch.Tensor]:
                    return {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}
                """
            )
        )
    if any(op.write for op in uses.all_of(Unshard)):
        methods.append(
            block(
                """
                def add_to_parameters(self, value: float) -> None:
                    with torch.no_grad():
                        for param in self.model.parameters():
                            param.add_(value)
                """
            )
        )
    if uses.rebuilds:
        methods.append(
            block(
                '''
                def reload(self, keep_optimizer: bool) -> None:
                    """What a save and a load into a fresh model leave: the values, no gradients, and the
                    optimizer's state only where the checkpoint holds it."""
                    for param in self.model.parameters():
                        param.grad = None
                    if not keep_optimizer:
                        self.optimizer = make_optimizer(<<params>>, ORACLE_LR)
                ''',
                params=optimizer_params(uses, "self.model"),
            )
        )
    head = block(
        '''
        class Oracle:
            """The program on one unsharded float32 model on CPU, in this process: data parallelism over
            WORLD_SIZE ranks optimises the mean of the rank losses, so each backward takes every rank's
            batch and adds the rank-averaged gradient."""

            def __init__(self) -> None:
                self.model = build_model(SEED, torch.device("cpu"))
                self.optimizer = make_optimizer(<<params>>, ORACLE_LR)
        ''',
        params=optimizer_params(uses, "self.model"),
    )
    text = head.rstrip("\n") + "\n\n" + "\n".join(textwrap.indent(m.strip("\n") + "\n", "    ") for m in methods)
    # 2-D: the ranks of one dp group feed one batch, so a pass sees DP_SIZE batches, not WORLD_SIZE.
    return text.replace("WORLD_SIZE", uses.data_ranks)


# -- checks ------------------------------------------------------------------------------------
def checks_part(uses: Uses) -> str:
    gather = ""
    if uses.tensor_parallel:
        gather = (
            "\n        if isinstance(got, DTensor):"
            "\n            got = got.full_tensor()  # a collective: every rank compares the same names in order"
        )
    text = block(
        '''
        def differences(
            actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: tuple[float, float, float]
        ) -> list[str]:
            """One line per name missing, unexpected or outside `tolerance`, the largest difference first."""
            rtol, atol, scaled_atol = tolerance
            problems = [(math.inf, f"{name}: missing") for name in sorted(expected.keys() - actual.keys())]
            problems += [(math.inf, f"{name}: unexpected") for name in sorted(actual.keys() - expected.keys())]
            for name in sorted(expected.keys() & actual.keys()):
                got = actual[name]<<gather>>
                got, want = got.detach().float().cpu(), expected[name]
                if got.shape != want.shape:
                    problems.append((math.inf, f"{name}: shape {tuple(got.shape)}, the oracle's {tuple(want.shape)}"))
                    continue
                if got.numel() == 0:
                    continue
                bound = atol + scaled_atol * want.abs().max().item()
                if torch.allclose(got, want, rtol=rtol, atol=bound):
                    continue
                difference = (got.double() - want.double()).abs().nan_to_num(nan=math.inf)
                index = tuple(int(i) for i in torch.unravel_index(difference.argmax(), difference.shape))
                largest = difference[index].item()
                problems.append(
                    (
                        largest,
                        f"{name}: max abs difference {largest:.3g} at index {index} "
                        f"({got[index].item():.9g}, the oracle's {want[index].item():.9g})",
                    )
                )
            return [line for _, line in sorted(problems, key=lambda problem: -problem[0])]
        ''',
        gather=gather,
    )
    if uses.backend == FSDP1 and uses.shows:
        text += "\n\n" + block(
            '''
            def original_name(name: str) -> str:
                """A parameter's name in the unwrapped model (FSDP1 wrappers add _fsdp_wrapped_module)."""
                return name.replace("_fsdp_wrapped_module.", "")
            '''
        )
    if uses_ddp_wrapper(uses) and uses.shows:
        text += "\n\n" + block(
            '''
            def original_name(name: str) -> str:
                """A parameter's name in the unwrapped model (DistributedDataParallel holds it as .module)."""
                return name.removeprefix("module.")
            '''
        )
    if uses.no_sync and (uses.backend == FSDP2 or (uses.backend == ZERO and not uses_ddp_wrapper(uses))):
        text += "\n\n" + block(
            '''
            @contextlib.contextmanager
            def gradient_sync_off(sharded: nn.Module):
                """Backward passes inside accumulate local gradients without reducing them."""
                sharded.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    sharded.set_requires_gradient_sync(True)
            '''
        )
    return text
