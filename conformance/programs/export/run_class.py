"""The script's ``Run`` class: the sharded model beside the oracle, and the methods of the training
operations (backward, gradients, eval, forward order, state dicts).
"""

from __future__ import annotations

import textwrap

from conformance.programs.export.operations import native_method, optim_method, save_load_method, unshard_method
from conformance.programs.export.sharding import mesh_parameter
from conformance.programs.export.uses import (
    FSDP1,
    FSDP2,
    ZERO,
    Uses,
    block,
    data_rank_expression,
    indented,
    sync_off_call,
    uses_ddp_wrapper,
)
from conformance.programs.program import Backward, ClipStep, EvalForward, Unshard


# -- the run: state and one method per kind of operation ----------------------------------------
def run_class_part(uses: Uses) -> str:
    parameter, _ = mesh_parameter(uses)
    mesh_argument = ", self.mesh" if uses.mesh is not None else ""
    deferred = uses.program.model.deferred_init
    if deferred:
        build = [
            "# Deferred initialization: the model is built on the meta device (no storage) and the backend",
            "# materializes it with the values of one built on CPU, which only its init reads.",
            'source = build_model(seed, torch.device("cpu"))',
            'with torch.device("meta"):',
            "    self.model = Model()",
        ]
    else:
        build = ["self.model = build_model(seed, DEVICE)"]
    if uses.tensor_parallel:
        mesh_argument = ', self.mesh["dp"]'
        build += [
            "# 2-D: tensor parallelism over the tp dimension first (block 0's linear column-wise, block 1's",
            "# row-wise), then the model sharded over the dp dimension.",
            'plan = {"blocks.0.linear": ColwiseParallel(), "blocks.1.linear": RowwiseParallel()}',
            'parallelize_module(self.model, self.mesh["tp"], plan)',
        ]
    build += [
        f"self.sharded = shard(self.model{mesh_argument}{', source' if deferred else ''})",
        "self.optimizer = make_sharded_optimizer(self.sharded)",
    ]
    if uses.order_checked and uses.route_can_differ:
        build += [
            "self.first_route: list[int] | None = None  # the order of the first training forward",
            "self.order_warned = False",
        ]
    init = ["self.rank = rank"]
    if uses.tensor_parallel:
        init.append("self.data_rank = rank // TP_SIZE  # whose batch this rank feeds: its dp group's")
    if uses.mesh is not None:
        init.append("self.mesh = mesh  # built once: every model the program shards (a fresh one per load) shares it")
    init += [
        "self.oracle = Oracle()",
        "self.iteration = 0  # data iterations fed so far (the oracle feeds the same)",
    ]
    if uses.has(EvalForward):
        init.append("self.evals = 0")
    init += ['self.where = "before op 0"', "self.mismatches = 0", "self.build(SEED)"]
    methods = [
        block(
            '''
            def __init__(self, rank: int<<parameter>>) -> None:
            <<init>>

            def build(self, seed: int) -> None:
                """Build the model (values from `seed`), shard it and make its optimizer."""
            <<build>>

            @contextlib.contextmanager
            def op(self, index: int, operation: str):
                """Run operation `index`: its mismatches name it, and so does an error it raises."""
                self.where = f"op {index} ({operation})"
                try:
                    yield
                except Exception as error:
                    print(f"rank {self.rank}, {self.where}: raised {type(error).__name__}: {error}", flush=True)
                    raise

            def mismatch(self, text: str) -> None:
                print(f"rank {self.rank}, {self.where}: {text}", flush=True)
                self.mismatches += 1

            def compare(self, actual: dict, expected: dict[str, torch.Tensor], tolerance: tuple, what: str) -> None:
                found = differences(actual, expected, tolerance)
                if found:
                    rtol, atol, scaled_atol = tolerance
                    bound = f"rtol {rtol:g}, atol {atol:g} + {scaled_atol:g} x max|oracle|"
                    lines = "".join(f"\\n  {line}" for line in found)
                    self.mismatch(f"{what} differ from the oracle's: {len(found)} of {len(expected)} ({bound}):{lines}")

            def check_loss(self, what: str, loss: float, expected: float) -> None:
                if abs(loss - expected) > LOSS_ATOL + LOSS_RTOL * abs(expected):
                    self.mismatch(
                        f"{what} {loss:.9g}, the oracle's {expected:.9g} (difference {abs(loss - expected):.3g}; "
                        f"bound {LOSS_ATOL:g} + {LOSS_RTOL:g} x |oracle|)"
                    )

            def check_params(self, when: str) -> None:
                """The full parameters and buffers (the full state dict) against the oracle's."""
                state = <<full_state>>
                self.compare(state, self.oracle.state(), PARAM_TOLERANCE, f"the full state dict {when}")
            ''',
            parameter=parameter,
            init=indented(init, 1),
            build=indented(build, 1),
            full_state=_full_state_call(uses),
        )
    ]
    methods += _state_dict_methods(uses)
    if uses.shows:
        methods.append(_shown_method(uses))
    if uses.divergent_route:
        methods.append(_refusal_method(uses))
    if uses.has(Backward) and not uses.divergent_route:
        methods.append(_backward_method(uses))
    if uses.grads_checked:
        methods.append(_grads_method(uses))
    if uses.reads_grads:
        methods.append(_compare_grads_method(uses))
    if uses.has(EvalForward):
        methods.append(_eval_method(uses))
    if uses.has(ClipStep):
        methods.append(_clip_method(uses))
    if uses.order_checked:
        methods.append(_order_method(uses))
    if uses.has(Unshard):
        methods.append(unshard_method(uses))
    if uses.save_kinds - {"native"}:
        methods.append(save_load_method(uses))
    if uses.native:
        methods.append(native_method(uses))
    if uses.optim_kinds:
        methods.append(optim_method(uses))
    head = block(
        '''
        class Run:
            """The sharded model and its optimizer beside the oracle, and the count of mismatches found."""
        '''
    )
    return head.rstrip("\n") + "\n\n" + "\n".join(textwrap.indent(m.strip("\n") + "\n", "    ") for m in methods)


def _full_state_call(uses: Uses) -> str:
    return "self.full_state_dict()" if uses.backend == ZERO else "self.model_state_dict(full=True)"


def _state_dict_methods(uses: Uses) -> list[str]:
    if uses.backend == ZERO:
        methods = [
            block(
                '''
                def full_state_dict(self) -> dict[str, torch.Tensor]:
                    """The whole model's state: every rank holds it whole (copies, as a gathered one would be)."""
                    return {name: value.detach().clone() for name, value in self.model.state_dict().items()}
                '''
            )
        ]
        if uses.rebuilds:
            methods.append(
                block(
                    """
                    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
                        self.model.load_state_dict(state, strict=True)
                    """
                )
            )
        return methods
    if uses.backend == FSDP1:
        if uses.sharded_state_dicts:
            kind = block(
                """
                if full:
                    return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
                return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()
                """
            )
        else:
            kind = "return StateDictType.FULL_STATE_DICT, FullStateDictConfig()\n"
        methods = [
            block(
                '''
                def model_state_dict(self, full: bool) -> dict:
                    with FullyShardedDataParallel.state_dict_type(self.sharded, *self.state_dict_type(full)):
                        return self.sharded.state_dict()

                @staticmethod
                def state_dict_type(full: bool) -> tuple:
                    """A fresh config per call (FSDP1 may change the one it is given)."""
                <<kind>>
                ''',
                kind=textwrap.indent(kind.strip("\n"), "    "),
            )
        ]
        if uses.rebuilds:
            methods.append(
                block(
                    """
                    def load_model_state(self, state: dict, full: bool) -> None:
                        with FullyShardedDataParallel.state_dict_type(self.sharded, *self.state_dict_type(full)):
                            self.sharded.load_state_dict(state)
                    """
                )
            )
    else:
        methods = [
            block(
                """
                def model_state_dict(self, full: bool) -> dict:
                    return get_model_state_dict(self.sharded, options=StateDictOptions(full_state_dict=full))
                """
            )
        ]
        if uses.rebuilds:
            methods.append(
                block(
                    """
                    def load_model_state(self, state: dict, full: bool) -> None:
                        set_model_state_dict(self.sharded, state, options=StateDictOptions(full_state_dict=full))
                    """
                )
            )
    if uses.optim_kinds or uses.native:
        methods.append(
            block(
                """
                def optimizer_state_dict(self, full: bool) -> dict:
                    options = StateDictOptions(full_state_dict=full)
                    return get_optimizer_state_dict(self.sharded, self.optimizer, options=options)

                def load_optimizer_state(self, state: dict, full: bool) -> None:
                    options = StateDictOptions(full_state_dict=full)
                    set_optimizer_state_dict(self.sharded, self.optimizer, state, options=options)
                """
            )
        )
    return methods


def _shown_method(uses: Uses) -> str:
    reads_grads = uses.grads_checked or uses.unshard_reads_grads
    rename = "name" if uses.backend == FSDP2 or (uses.backend == ZERO and not uses_ddp_wrapper(uses)) else None
    key = rename or "original_name(name)"
    if reads_grads:
        return block(
            '''
            def shown(self, grads: bool) -> dict[str, torch.Tensor]:
                """What the sharded model's parameters (or their gradients) show now, float32 on CPU."""
                shown = {}
                for name, param in self.sharded.named_parameters():
                    value = param.grad if grads else param
                    if value is not None:
                        shown[<<key>>] = value.detach().float().cpu().clone()
                return shown
            ''',
            key=key,
        )
    return block(
        '''
        def shown(self) -> dict[str, torch.Tensor]:
            """What the sharded model's parameters show now, float32 on CPU."""
            return {<<key>>: p.detach().float().cpu().clone() for name, p in self.sharded.named_parameters()}
        ''',
        key=key,
    )


def _refusal_method(uses: Uses) -> str:
    return block(
        '''
        def first_pass_in_divergent_orders(self) -> None:
            """The ranks run their first forward in different block orders: FSDP1, asked to check the
            order (check_exec_order, TORCH_DISTRIBUTED_DEBUG=DETAIL), must refuse it."""
            x = local_batch(self.iteration, self.rank).to(DEVICE)
            try:
                loss_of(self.sharded(x)).backward()
            except Exception as error:  # noqa: BLE001 - any error refuses (with use_orig_params FSDP1 raises KeyError)
                print(f"rank {self.rank}: refused, as it should be: {type(error).__name__}: {error}", flush=True)
                return
            self.mismatch(
                "the ranks ran the first iteration in different forward orders (blocks 0 and 1 swapped on odd "
                "ranks) and FSDP1, asked to check the order (check_exec_order=True), did not refuse it"
            )
        '''
    )


def _backward_method(uses: Uses) -> str:
    order = uses.order_checked
    if uses.no_sync:
        doc = [
            '"""`micro_batches` forward + backward passes, each on a batch of its own (with `no_sync`, the',
            'first `micro_batches - 1` without gradient sync); each loss against the oracle\'s."""',
        ]
    else:
        doc = [
            '"""`micro_batches` forward + backward passes, each on a batch of its own; each loss against',
            'the oracle\'s."""',
        ]
    lines = [
        *doc,
        "expected = [self.oracle.backward(self.iteration + index) for index in range(micro_batches)]",
        "for micro_batch in range(micro_batches):",
        f"    x = local_batch(self.iteration, {data_rank_expression(uses)}).to(DEVICE)",
        "    self.iteration += 1",
    ]
    inner = ["loss = loss_of(self.sharded(x))", "loss.backward()"]
    if uses.no_sync:
        inner = [
            "unsynced = no_sync and micro_batch < micro_batches - 1",
            f"with {sync_off_call(uses)} if unsynced else contextlib.nullcontext():",
            *("    " + line for line in inner),
        ]
    if order:
        route = ["route = self.model.route()"] if uses.route_can_differ else []
        inner = [
            *route,
            "with warnings.catch_warnings(record=True) as caught:",
            '    warnings.simplefilter("always")',
            *("    " + line for line in inner),
        ]
        if uses.route_can_differ:
            inner += [
                "self.check_order_warnings(caught, route, training=True)",
                "if self.first_route is None:",
                "    self.first_route = route",
            ]
        else:
            inner.append("self.check_no_order_warning(caught)")
    lines += ["    " + line for line in inner]
    lines.append('    what = f"micro-batch {micro_batch}: loss"')
    lines.append(f"    self.check_loss(what, loss.item(), expected[micro_batch][{data_rank_expression(uses)}])")
    if uses.grads_checked:
        lines.append("self.check_grads()")
    signature = (
        "def forward_backward(self, micro_batches: int, no_sync: bool = False) -> None:"
        if uses.no_sync
        else "def forward_backward(self, micro_batches: int) -> None:"
    )
    return signature + "\n" + indented(lines, 1) + "\n"


def _grads_method(uses: Uses) -> str:
    if uses.backend == ZERO:
        return block(
            '''
            def check_grads(self) -> None:
                """The gradients after a backward (DistributedDataParallel leaves them whole, all-reduced, on
                every rank) against the oracle's."""
                self.compare_grads(self.shown(grads=True), "the full gradients after backward")
            '''
        )
    return block(
        '''
        def check_grads(self) -> None:
            """The full gradients after a backward (gathered by summon_full_params) against the oracle's."""
            with FullyShardedDataParallel.summon_full_params(self.sharded, writeback=False, with_grads=True):
                shown = self.shown(grads=True)
            self.compare_grads(shown, "the full gradients after backward")
        '''
    )


def _compare_grads_method(uses: Uses) -> str:
    if not uses.program.model.frozen:
        return block(
            """
            def compare_grads(self, shown: dict[str, torch.Tensor], what: str) -> None:
                self.compare(shown, self.oracle.grads(), GRAD_TOLERANCE, what)
            """
        )
    return block(
        '''
        def compare_grads(self, shown: dict[str, torch.Tensor], what: str) -> None:
            """The trained parameters' gradients against the oracle's; a frozen one must show none."""
            frozen_shown = sorted(name for name in shown if name in FROZEN)
            if frozen_shown:
                self.mismatch(
                    "frozen parameters (requires_grad=False) show a gradient inside unshard(with_grads=True): "
                    f"{frozen_shown}; torch leaves their .grad None"
                )
            trained = {name: grad for name, grad in shown.items() if name not in FROZEN}
            self.compare(trained, self.oracle.grads(), GRAD_TOLERANCE, what)
        '''
    )


def _eval_method(uses: Uses) -> str:
    lines = [
        '"""One forward under no_grad in the current mode; its loss against the oracle\'s."""',
        f"x = local_batch(EVAL_ITERATIONS + self.evals, {data_rank_expression(uses)}).to(DEVICE)",
        f"expected = self.oracle.eval_losses(self.evals)[{data_rank_expression(uses)}]",
        "self.evals += 1",
    ]
    forward = ["with torch.no_grad():", "    loss = loss_of(self.sharded(x)).item()"]
    if uses.order_checked:
        route = ["route = self.model.route()"] if uses.route_can_differ else []
        check = (
            "self.check_order_warnings(caught, route, training=False)"
            if uses.route_can_differ
            else "self.check_no_order_warning(caught)"
        )
        forward = [
            *route,
            "with warnings.catch_warnings(record=True) as caught:",
            '    warnings.simplefilter("always")',
            *("    " + line for line in forward),
            check,
        ]
    lines += forward
    lines += [
        'mode = "training" if self.oracle.model.training else "eval"',
        'self.check_loss(f"loss under no_grad in {mode} mode:", loss, expected)',
    ]
    return "def eval_forward(self) -> None:\n" + indented(lines, 1) + "\n"


def _order_method(uses: Uses) -> str:
    if not uses.route_can_differ:
        return block(
            '''
            def check_no_order_warning(self, caught: list) -> None:
                """The forward order never changes in this program: FSDP1 must not warn about it."""
                issued = [str(w.message) for w in caught if ORDER_WARNING in str(w.message)]
                if issued:
                    self.mismatch(f"a forward issued forward-order warnings it should not: {issued}")
            '''
        )
    return block(
        '''
        def check_order_warnings(self, caught: list, route: list[int], training: bool) -> None:
            """FSDP1 (check_exec_order) warns in the first training pass whose block order differs from
            the first iteration's (once per unit out of order), and in no other pass, eval forwards included."""
            issued = [str(w.message) for w in caught if ORDER_WARNING in str(w.message)]
            due = training and self.first_route is not None and not self.order_warned and route != self.first_route
            if due:
                self.order_warned = True
            if due and not issued:
                self.mismatch(
                    f"a training forward whose order differs from the first iteration's ({route} after "
                    f"{self.first_route}) issued no forward-order warning"
                )
            elif issued and not due:
                what = "a training" if training else "an eval"
                self.mismatch(f"{what} forward issued forward-order warnings it should not: {issued}")
        '''
    )


def _clip_method(uses: Uses) -> str:
    if uses.backend == FSDP1:
        clip = "\n".join(
            [
                "# FSDP1's own clip: the norm over every rank's shard of the flat parameters.",
                "returned = float(self.sharded.clip_grad_norm_(max_norm))",
            ]
        )
    else:
        what = "DTensor gradients (a DTensor norm)" if uses.backend == FSDP2 else "whole gradients on every rank"
        clip = "\n".join(
            [
                f"# torch's clip over {what}.",
                "clipped = torch.nn.utils.clip_grad_norm_(list(self.sharded.parameters()), max_norm)",
                'full = getattr(clipped, "full_tensor", None)',
                "returned = float(full() if callable(full) else clipped)",
            ]
        )
    return block(
        '''
        def clip_and_step(self, fraction: float) -> None:
            """Clip the gradients to `fraction` x the oracle's total norm (so the clip acts), the norm the
            clip returns against the oracle's, then an optimizer step of both."""
            expected, max_norm = self.oracle.clip(fraction)
        <<clip>>
            if abs(returned - expected) > GRAD_NORM_RTOL * expected:
                self.mismatch(
                    f"clip_grad_norm_ returned the total norm {returned:.7g}; the oracle's averaged gradient has "
                    f"norm {expected:.7g} (relative bound {GRAD_NORM_RTOL:g})"
                )
            self.optimizer.step()
            self.oracle.optimizer.step()
            self.check_params("after the clipped step")
        ''',
        clip=textwrap.indent(clip, "    "),
    )
