"""Prepare: render prompts, tokenize them with the model's own tokenizer, bucket them.

Input: a batch of corpus rows. Output: the same rows, plus `prompt_tokens`,
`bucket`, `status`, `error` and the working columns `_prompt_token_ids` and
`_bucket_index`. A row that cannot be prompted (null text, or a prompt that
cannot fit the context with room to answer) leaves here with status `error`
and is carried to the output without reaching the engine.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipeline import schema
from pipeline.bucketing import LengthBucketer
from pipeline.config import RunConfig
from pipeline.schema import Status


class PromptRenderer:
    """Job template + system message -> the exact text the model sees."""

    def __init__(self, tokenizer: Any, template: str, system: str | None):
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def render(self, row: dict[str, Any]) -> str:
        user = self.template.format_map(row)
        if not self.chat:
            return user if self.system is None else f"{self.system}\n\n{user}"
        messages = [{"role": "user", "content": user}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def context_limit(model: str, max_model_len: int | None) -> int:
    """The context length the engine will run with: configured, else the model's."""
    if max_model_len is not None:
        return max_model_len
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).max_position_embeddings)


class PrepareStage:
    """Tokenizing stage; one per actor, the tokenizer loaded once."""

    def __init__(self, config: RunConfig, model_path: str, max_model_len: int):
        self.text_column = config.job.input.text_column
        self.max_new_tokens = config.job.sampling.max_new_tokens
        self.max_prompt_tokens = max_model_len - self.max_new_tokens
        self.bucketer = LengthBucketer(config.profile.batching.bucket_boundaries)
        self.tokenizer = load_tokenizer(model_path)
        self.renderer = PromptRenderer(
            self.tokenizer, config.job.prompt.template, config.job.prompt.system
        )
        # The chat template spells out its special tokens; adding them again
        # would double the BOS.
        self.add_special_tokens = not self.renderer.chat

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        n = len(rows)
        status = [Status.OK.value] * n
        error: list[str | None] = [None] * n

        # 1. Render; a row that cannot be rendered is an error row, not a crash.
        prompts: list[str] = []
        renderable: list[int] = []
        for i, row in enumerate(rows):
            if row.get(self.text_column) is None:
                status[i], error[i] = Status.ERROR.value, f"{self.text_column} is null"
                continue
            prompts.append(self.renderer.render(row))
            renderable.append(i)

        # 2. Tokenize the whole batch in one call (the fast tokenizer parallelises it).
        token_ids: list[list[int]] = [[] for _ in range(n)]
        if prompts:
            encoded = self.tokenizer(prompts, add_special_tokens=self.add_special_tokens)["input_ids"]
            for i, ids in zip(renderable, encoded):
                token_ids[i] = ids

        # 3. Bucket, and refuse what cannot fit the context with room to answer.
        prompt_tokens = [len(ids) for ids in token_ids]
        for i in renderable:
            if prompt_tokens[i] > self.max_prompt_tokens:
                status[i] = Status.ERROR.value
                error[i] = (
                    f"prompt is {prompt_tokens[i]} tokens; the context fits "
                    f"{self.max_prompt_tokens} with {self.max_new_tokens} left to generate"
                )
                token_ids[i] = []
        index = [self.bucketer.index(t) for t in prompt_tokens]

        return (
            batch.append_column("prompt_tokens", pa.array(prompt_tokens, pa.int32()))
            .append_column("bucket", pa.array([self.bucketer.names[k] for k in index], pa.string()))
            .append_column("status", pa.array(status, pa.string()))
            .append_column("error", pa.array(error, pa.string()))
            .append_column(schema.BUCKET_INDEX, pa.array(index, pa.int32()))
            .append_column(schema.PROMPT_TOKEN_IDS, pa.array(token_ids, pa.list_(pa.int32())))
        )
