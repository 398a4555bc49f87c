"""Requests in and out of an LLMEngine: a prompt checked against the model's context and vocabulary, a
request's sequences (n > 1 forks the others from the first once its prompt is computed), aborts, and the
stop strings a core process's front end matched.

A mixin of LLMEngine (engine.py), which holds the state named below; the step loop is there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvflow.engine.detokenizer import NO_DETOKENIZER, IncrementalDetokenizer
from kvflow.engine.request import (
    Request,
    RequestGroup,
    RequestStatus,
    ScheduledSequence,
    SchedulerOutput,
    SequenceState,
)
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.structured.sequence_grammar import SequenceGrammar

if TYPE_CHECKING:
    from kvflow.engine.scheduler import Scheduler
    from kvflow.engine.speculation import Speculator
    from kvflow.executors.model_setup import LoadedModel
    from kvflow.structured.compiler import GrammarCompiler


def tokenize_prompt(tokenizer, prompt: str) -> list[int]:
    # A prompt rendered by a chat template often starts with BOS already: don't add a second one.
    bos = tokenizer.bos_token
    return tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos))).input_ids


class RequestIntake:
    # Set by LLMEngine.__init__.
    loaded: LoadedModel
    tokenizer: object
    max_model_len: int
    scheduler: Scheduler
    speculator: Speculator | None
    eos_token_ids: list[int]
    groups: dict[str, RequestGroup]
    sequences: dict[str, SequenceState]  # by engine request id
    detokenize: bool
    grammars: GrammarCompiler
    _counter: int

    def _eos_ids(self) -> list[int]:
        ids = list(self.loaded.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.insert(0, self.tokenizer.eos_token_id)
        return ids

    def tokenize(self, prompt: str) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    def next_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; raises ValueError (with both lengths) when it cannot fit the context."""
        params = params or SamplingParams()
        request_id = request_id or self.next_request_id()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_prompt(token_ids, params)
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)  # a GrammarError (ValueError) before queueing
        group = RequestGroup(request_id, text, token_ids, params, children_to_fork=params.n - 1)
        first = self._new_sequence(group, 0, request_id if params.n == 1 else f"{request_id}#0", arrival_time)
        self.scheduler.add_request(first.request)  # raises ValueError if it can never fit the pool
        self.groups[request_id] = group
        self.sequences[first.request.request_id] = first
        return request_id

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                f"(at least one must be left to generate)"
            )
        vocab = self.loaded.arch.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        for name in ("logit_bias", "logprob_token_ids"):
            outside = [t for t in getattr(params, name) or () if t >= vocab]
            if outside:
                raise ValueError(f"SamplingParams.{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: together more than "
                f"the model's context of {self.max_model_len} tokens"
            )

    def _new_sequence(
        self, group: RequestGroup, index: int, engine_id: str, arrival_time: float | None
    ) -> SequenceState:
        params = group.params
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            # Extra end-of-turn ids (Llama 3's <|eot_id|>...) stop like EOS does.
            extra = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
            params = _with_stop_ids(params, extra)
        request = Request(engine_id, group.prompt_token_ids, params, self.eos_token_ids[0] if self.eos_token_ids
                          else None, arrival_time)
        if params.prompt_logprobs is not None and index == 0 and request.num_prompt_tokens > 1:
            request.prompt_logits_from = 0  # the first sequence scores the prompt for the group
        seed = None if params.seed is None else params.seed + index
        state = SequenceState(
            group_id=group.request_id,
            index=index,
            request=request,
            detokenizer=(IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, params) if self.detokenize
                         else NO_DETOKENIZER),
            seed=seed,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            grammar=None if params.structured_output is None else SequenceGrammar(self.grammars,
                                                                                 params.structured_output),
        )
        group.sequences.append(state)
        return state

    def _fork_children(self, sched: SchedulerOutput, group: RequestGroup, parent: SequenceState) -> list:
        """n > 1: once the prompt is computed, the other n - 1 sequences start from the parent's KV blocks."""
        if group.children_to_fork == 0 or parent.index != 0:
            return []
        children = []
        for index in range(1, group.children_to_fork + 1):
            child = self._new_sequence(group, index, f"{group.request_id}#{index}", None)
            child.request.timings.arrival_time = parent.request.timings.arrival_time
            self.scheduler.fork_request(parent.request, child.request)
            self.sequences[child.request.request_id] = child
            if child.request.status == RequestStatus.RUNNING:
                # Bookkeeping entry only (no tokens to compute): lets update_from_output append its token.
                sched.scheduled.append(ScheduledSequence(
                    child.request, child.request.num_computed_tokens, 0,
                    self.scheduler.kv_cache_manager.get_block_ids(child.request.request_id), True,
                ))
                children.append(child)
        group.children_to_fork = 0
        return children

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason "abort")."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        group.children_to_fork = 0
        for seq in group.sequences:
            self.scheduler.abort_request(seq.request.request_id)
            self.sequences.pop(seq.request.request_id, None)
            if self.speculator is not None:
                self.speculator.forget(seq.request)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return group.output()

    def stop_sequence(self, request_id: str, index: int, stop_string: str) -> bool:
        """End one sequence of a request on a stop string its front end matched (engine/output_assembly.py)
        and free its blocks; True when that ended the whole request (it is then forgotten: its front end has
        already given the caller its last output)."""
        group = self.groups.get(request_id)
        if group is None or index >= len(group.sequences):
            return False
        seq = group.sequences[index]
        if seq.finish_reason is None:
            self.scheduler.finish_request(seq.request.request_id, RequestStatus.FINISHED_STOPPED, stop_string)
            seq.finish_reason = "stop"
            if self.speculator is not None:
                self.speculator.forget(seq.request)
        if group.finished:
            self._drop(group)
            return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def _group_of(self, seq: SequenceState) -> RequestGroup:
        return self.groups[seq.group_id]

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.sequences:
            self.sequences.pop(seq.request.request_id, None)
            if self.speculator is not None:
                self.speculator.forget(seq.request)


def _with_stop_ids(params: SamplingParams, extra: list[int]) -> SamplingParams:
    if not extra:
        return params
    return replace(params, stop_token_ids=list(params.stop_token_ids) + extra)
