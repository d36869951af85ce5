"""Prepare: render prompts, tokenize them with the model's own tokenizer, bucket them.

Input: a batch of corpus rows. Output: the same rows, plus `prompt_tokens`,
`truncated`, `original_tokens`, `chunks`, `bucket`, `status`, `error`,
`notes` and the working columns `_prompt_token_ids`, `_chunk_texts` and
`_bucket_index` (and `_annotation_token_ids` when the job annotates). A row
that cannot be prompted (a null id; text that is null, empty, whitespace or
not a string; a string cell that is not valid UTF-8) leaves here with status
`error` and its reason, and is carried to the output without reaching the engine.

Row data is data, never instructions: templates name columns (and struct
fields) only, values are put in as they are (a null as `null_as`), and text
that comes from the row is tokenized with special-token parsing off, so a
document holding `<|im_start|>system` cannot open a chat turn. Only the job's
own text and the chat template's markup become control tokens.

With `passages:` in the job, each document first becomes one row per passage
(token windows with overlap, ending at paragraph or sentence breaks where
possible): the text column is replaced by `passage`, `passage_index`,
`char_start` and `char_end`, and everything after works on passages.
"""

from __future__ import annotations

import string
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema
from pipeline.text.bucketing import DEFAULT_BOUNDARIES, LengthBucketer
from pipeline.config import LengthConfig, PassagesConfig
from pipeline.config.models import parse_template
from pipeline.generation.result_key import input_key
from pipeline.text.length import char_span, truncate_ids, windows
from pipeline.schema import Status


@dataclass(frozen=True)
class Prompt:
    template: str  # the user message; `{column}` and `{struct_column.field}` fields
    system: str | None = None


@dataclass(frozen=True)
class PrepareSettings:
    """What the prepare stage needs, and nothing more (the runner derives it from the config)."""

    model_path: str  # its tokenizer and chat template
    max_model_len: int
    prompt: Prompt
    max_new_tokens: int  # room left for the output: the prompt gets the rest
    id_column: str = "id"
    text_column: str = "text"
    length: LengthConfig = LengthConfig()
    bucket_boundaries: tuple[int, ...] = tuple(DEFAULT_BOUNDARIES)
    passages: PassagesConfig | None = None
    annotation_prompt: Prompt | None = None
    annotation_max_new_tokens: int = 0
    cap_tokens: int | None = None  # the corpus percentile cap, when the job asks for one
    delay_s: float = 0.0  # debug: each batch takes this much longer, as a slow store's reads would
    # Debug: past `hold_after_rows` rows, each batch waits (at most `hold_s`) for a file in `hold_until`.
    hold_until: str | None = None
    hold_after_rows: int = 0
    hold_s: float = 0.0
    null_as: str = ""  # what a null field renders as
    # The run's share of every row's input key (`pipeline.generation.result_key.input_key_base`);
    # None: rows get no input key (no result key, or a passages job).
    input_key_base: str | None = None

    def prompt_parts(self) -> dict[str, Any]:
        """The settings that turn a row into its prompts, for the input key: all but the
        model's path (its content is in the key's base) and the debug drills."""
        parts = asdict(self)
        for name in ("model_path", "delay_s", "hold_until", "hold_after_rows", "hold_s", "input_key_base"):
            parts.pop(name)
        return parts


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt in the pieces it is tokenized in: an int is a control token the job's
    template or the chat template put there; a string is text, tokenized with
    special-token parsing off (it may hold row data)."""

    pieces: tuple[int | str, ...]

    def text(self, tokenizer: Any) -> str:
        """For people: the prompt as one string."""
        return "".join(p if isinstance(p, str) else tokenizer.convert_ids_to_tokens(p) for p in self.pieces)


class PromptRenderer:
    """Job template + system message -> the pieces of the prompt the model sees.

    The prompt is rendered once, at construction, with a unique sentinel in
    place of each field, and cut at the control tokens that the trusted text
    (system message, template, chat template) holds. A row's prompt is that
    skeleton with the row's values in place of the sentinels: the values are
    never formatted (no `str.format` on row data) and never parsed for
    control tokens. Cutting at control tokens is what the tokenizer itself
    does before tokenizing the text between them, so a clean row gets the
    same ids as tokenizing the whole prompt would give.
    """

    def __init__(self, tokenizer: Any, template: str, system: str | None, null_as: str = ""):
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        self.null_as = null_as
        self.chat = getattr(tokenizer, "chat_template", None) is not None
        self.fields = parse_template(template)
        nonce = uuid.uuid4().hex
        sentinels = [f"\ue000{nonce}.{k}\ue001" for k in range(len(self.fields))]
        slots = iter(sentinels)
        user = "".join(literal + ("" if name is None else next(slots))
                       for literal, name, _, _ in string.Formatter().parse(template))
        skeleton = self._wrap(user)
        # 1. Where the sentinels landed: each once, in order, or the chat template rewrote the message.
        at = [skeleton.find(x) for x in sentinels]
        if any(a < 0 for a in at) or at != sorted(at) or any(skeleton.count(x) != 1 for x in sentinels):
            raise ValueError("the chat template does not keep the user message as written; "
                             "its fields cannot be placed safely")
        # 2. The control tokens of the trusted text: (start, end, id).
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        enc = tokenizer(skeleton, add_special_tokens=False, return_offsets_mapping=True)
        controls = [(a, b, i) for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if i in added]
        # 3. The skeleton as [control id | [literal str | field index, ...]].
        self.skeleton: list[int | list[str | int]] = []
        cut = 0
        for a, b, i in controls + [(len(skeleton), len(skeleton), None)]:
            self.skeleton.append(self._segment(skeleton[cut:a], sentinels))
            if i is not None:
                self.skeleton.append(i)
            cut = b
        # 4. What the tokenizer adds around a whole prompt (a BOS), without a chat template.
        self.prefix: list[int] = []
        self.suffix: list[int] = []
        if not self.chat:
            bare = tokenizer("a", add_special_tokens=False)["input_ids"]
            full = tokenizer("a", add_special_tokens=True)["input_ids"]
            at_bare = next((k for k in range(len(full)) if full[k:k + len(bare)] == bare), 0)
            self.prefix, self.suffix = full[:at_bare], full[at_bare + len(bare):]

    def _wrap(self, user: str) -> str:
        if not self.chat:
            return user if self.system is None else f"{self.system}\n\n{user}"
        messages = [{"role": "user", "content": user}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @staticmethod
    def _segment(text: str, sentinels: list[str]) -> list[str | int]:
        out: list[str | int] = []
        while text:
            hits = [(text.find(x), k) for k, x in enumerate(sentinels) if x in text]
            if not hits:
                out.append(text)
                break
            a, k = min(hits)
            out.extend([text[:a], k])
            text = text[a + len(sentinels[k]):]
        return out

    def value(self, row: dict[str, Any], column: str, sub: str | None) -> str:
        """A field's text: a null column, null struct or null struct field is `null_as`."""
        value = row.get(column)
        if sub is not None:
            value = value.get(sub) if isinstance(value, dict) else None
        if value is None:
            return self.null_as
        if isinstance(value, (bytes, bytearray)):
            return bytes(value).decode("utf-8", errors="replace")
        return value if isinstance(value, str) else str(value)

    def render(self, row: dict[str, Any]) -> RenderedPrompt:
        values = [self.value(row, column, sub) for column, sub in self.fields]
        pieces: list[int | str] = list(self.prefix)
        for part in self.skeleton:
            if isinstance(part, int):
                pieces.append(part)
            else:
                pieces.append("".join(p if isinstance(p, str) else values[p] for p in part))
        pieces.extend(self.suffix)
        return RenderedPrompt(tuple(pieces))


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def context_limit(model: str, max_model_len: int | None) -> int:
    """The context length the engine will run with: configured, else the model's."""
    if max_model_len is not None:
        return max_model_len
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).max_position_embeddings)


@dataclass
class _Row:
    """One row's way through the stage."""

    status: str = Status.OK.value
    error: str | None = None
    notes: str | None = None
    text: str | None = None
    ids: list[int] = field(default_factory=list)
    original_tokens: int | None = None
    truncated: bool = False
    chunk_texts: list[str] | None = None
    prompt_tokens: int | None = None  # null when the row was never tokenized
    bucket_tokens: int = 0  # what the row is bucketed by: its prompt, or its windows' prompts
    prompt_text: str | None = None  # the text the prompt was rendered with, when truncation changed it
    annotation_ids: list[int] | None = None
    input_key: str | None = None
    earlier: dict[str, Any] | None = None  # found by its input key: what prepare made of it before

    def fail(self, status: Status, message: str) -> None:
        self.status, self.error, self.ids = status.value, message, []


def _as_text(value: Any) -> tuple[str | None, str | None, str | None]:
    """(text, error, note) for a text cell of any type."""
    if value is None:
        return None, "text is null", None
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).decode("utf-8", errors="replace")
        bad = text.count("\ufffd")
        note = "text was binary; decoded as UTF-8" + (f" with {bad} invalid sequences replaced" if bad else "")
        return text, None, note
    if not isinstance(value, str):
        return None, f"text is {type(value).__name__}, expected a string", None
    return value, None, None


def repair_utf8(batch: pa.Table) -> tuple[pa.Table, dict[int, list[str]]]:
    """The batch with every cell that is not valid UTF-8 made readable, and the columns
    that had such a cell, by row.

    pyarrow cannot turn such a cell into a Python string, and would fail the whole
    batch (and the run); instead the row becomes an error row. A string cell keeps
    its text with U+FFFD for the bad bytes; a nested cell (a struct holding one)
    becomes null. Valid batches cost one validation pass per column.
    """
    bad: dict[int, list[str]] = {}
    for k, name in enumerate(batch.column_names):
        column = batch.column(k)
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        broken = []
        for i in range(len(column)):
            try:
                column.slice(i, 1).to_pylist()
            except UnicodeDecodeError:
                broken.append(i)
                bad.setdefault(i, []).append(name)
        if not broken:
            continue
        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            raw = column.cast(pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()).to_pylist()
            repaired = pa.array([None if b is None else b.decode("utf-8", errors="replace") for b in raw], kind)
        else:
            hit = set(broken)
            mask = pa.array([i in hit for i in range(len(column))], pa.bool_())
            repaired = pc.if_else(mask, pa.nulls(len(column), kind), column)
        batch = batch.set_column(k, batch.field(k), repaired)
    return batch, bad


class PrepareStage:
    """Tokenizing stage; one per actor, the tokenizer loaded once.

    Rows too long for the model follow the job's length policy (see
    `pipeline.text.length`): truncated and flagged, cut into windows for
    map-reduce summarization, or skipped. `cap_tokens`, when given, caps the
    prompt further (the corpus percentile cap).
    """

    def __init__(self, settings: PrepareSettings, shards: list[Any] | None = None,
                 look_up: Callable[[pa.Table], pa.Table] | None = None):
        self.settings = settings
        # The reuse index's shards (`pipeline.reuse.index`): rows found there by their
        # input key are not tokenized. None: every row is.
        self.shards = shards
        # Each prepared batch's rows then looked up by their result keys
        # (`pipeline.reuse.index.keyed_look_up`). None: by a later stage, or not at all.
        self.look_up = look_up
        self.id_column = settings.id_column
        self.text_column = settings.text_column
        self.length = settings.length
        self.max_new_tokens = settings.max_new_tokens
        self.max_prompt_tokens = settings.max_model_len - self.max_new_tokens
        self.max_text_tokens = self.length.max_input_tokens
        self.cap_prompt_tokens = settings.cap_tokens
        self.bucketer = LengthBucketer(settings.bucket_boundaries)
        self.tokenizer = load_tokenizer(settings.model_path)
        self.renderer = PromptRenderer(self.tokenizer, settings.prompt.template, settings.prompt.system,
                                       settings.null_as)
        self.passages = settings.passages
        annotation = settings.annotation_prompt
        self.annotator = None if annotation is None else PromptRenderer(
            self.tokenizer, annotation.template, annotation.system, settings.null_as
        )
        self.max_annotation_prompt = settings.max_model_len - settings.annotation_max_new_tokens
        self.input_base = self._input_base()

    def _input_base(self) -> str | None:
        """The run's input-key base with what this stage makes of a template: the rendered
        skeletons (a chat template that renders the date changes them) and the tokenizer
        libraries' versions. The settings alone do not pin the prompts' token ids, which
        the result key digests but a row found by its input key never has."""
        base = self.settings.input_key_base
        if base is None:
            return None
        import hashlib

        import tokenizers
        import transformers

        made = [base, transformers.__version__, tokenizers.__version__,
                *(repr((r.skeleton, r.prefix, r.suffix)) for r in (self.renderer, self.annotator) if r is not None)]
        return hashlib.blake2b("\0".join(made).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()

    def encode(self, prompts: list[RenderedPrompt]) -> list[list[int]]:
        """Token ids of rendered prompts: their text pieces in one tokenizer call (the fast
        tokenizer parallelises it), special-token parsing off; their control tokens as they are."""
        texts = [p for prompt in prompts for p in prompt.pieces if isinstance(p, str)]
        if not texts:
            return [[p for p in prompt.pieces if isinstance(p, int)] for prompt in prompts]
        encoded = iter(self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        out = []
        for prompt in prompts:
            ids: list[int] = []
            for p in prompt.pieces:
                if isinstance(p, str):
                    ids.extend(next(encoded))
                else:
                    ids.append(p)
            out.append(ids)
        return out

    def render(self, row: dict[str, Any], text: str) -> RenderedPrompt:
        return self.renderer.render({**row, self.text_column: text})

    def _check(self, row: dict[str, Any], bad_utf8: list[str] | None = None) -> _Row:
        """Bad rows become error rows with a reason; nothing here raises."""
        w = _Row()
        if row.get(self.id_column) is None:
            w.fail(Status.ERROR, f"{self.id_column} is null")
            return w
        if bad_utf8:
            names = ", ".join(repr(n) for n in bad_utf8)
            w.fail(Status.ERROR, f"column{'s' if len(bad_utf8) > 1 else ''} {names} "
                                 f"{'are' if len(bad_utf8) > 1 else 'is'} not valid UTF-8")
            return w
        w.text, problem, w.notes = _as_text(row.get(self.text_column))
        if problem is None and not w.text.strip():
            problem = "text is empty" if not w.text else "text is whitespace only"
        if problem is not None:
            w.fail(Status.ERROR, problem)
        return w

    def split_passages(self, text: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of the passages of `text`: token windows of
        `passages.tokens` with `passages.overlap`, trimmed of surrounding whitespace."""
        assert self.passages is not None
        _, offsets = self.text_tokens(text)
        spans = []
        for s, e in windows(offsets, text, self.passages.tokens, self.passages.overlap):
            a, b = char_span(offsets, s, e)
            while a < b and text[a].isspace():
                a += 1
            while b > a and text[b - 1].isspace():
                b -= 1
            if a < b:
                spans.append((a, b))
        return spans

    def _explode(self, batch: pa.Table, work: list[_Row]) -> tuple[pa.Table, list[_Row]]:
        """One row per passage; a document that failed its checks stays one row."""
        take: list[int] = []
        out: list[_Row] = []
        index: list[int | None] = []
        spans: list[tuple[int | None, int | None]] = []
        for i, w in enumerate(work):
            if w.status != Status.OK:
                take.append(i)
                out.append(w)
                index.append(None)
                spans.append((None, None))
                continue
            for k, (a, b) in enumerate(self.split_passages(w.text)):
                take.append(i)
                out.append(_Row(text=w.text[a:b], notes=w.notes))
                index.append(k)
                spans.append((a, b))
        exploded = batch.take(pa.array(take, pa.int64())).drop_columns([self.text_column])
        columns = {
            "passage_index": pa.array(index, pa.int32()),
            "char_start": pa.array([a for a, _ in spans], pa.int64()),
            "char_end": pa.array([b for _, b in spans], pa.int64()),
            "passage": pa.array([w.text if w.status == Status.OK else None for w in out], pa.string()),
        }
        for name, values in columns.items():
            exploded = exploded.append_column(name, values)
        return exploded, out

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.settings.delay_s:
            time.sleep(self.settings.delay_s)
        self._hold(batch.num_rows)
        # 1. Bad rows become error rows with a reason; with passages, documents become passages.
        batch, bad_utf8 = repair_utf8(batch)
        rows = batch.to_pylist()
        work = [self._check(row, bad_utf8.get(i)) for i, row in enumerate(rows)]
        if self.passages is not None:
            batch, work = self._explode(batch, work)
            rows = batch.to_pylist()
        valid = [i for i, w in enumerate(work) if w.status == Status.OK]
        found = self._earlier(rows, work, valid)  # with reuse: rows made before, by their input key
        if found is not None:
            valid = [i for i in valid if work[i].earlier is None]

        # 2. Render and tokenize the batch in one call (the fast tokenizer parallelises it).
        for i, ids in zip(valid, self.encode([self.render(rows[i], work[i].text) for i in valid])):
            work[i].ids = ids
            work[i].prompt_tokens = work[i].bucket_tokens = len(ids)
        self._fit_long_rows(rows, work, valid)  # 3.
        if self.annotator is not None:
            self._annotation_prompts(rows, work, valid)  # 4.
        for name, values in self._columns(work).items():  # 5.
            batch = batch.append_column(name, values)
        if found is not None:
            for name in found.column_names:
                batch = batch.append_column(name, found.column(name))
        return batch if self.look_up is None else self.look_up(batch)  # 6. with reuse: by result key

    def _earlier(self, rows: list[dict[str, Any]], work: list[_Row], valid: list[int]) -> pa.Table | None:
        """1b. Each valid row's input key; with the reuse index, the earlier rows found by
        them (`_reused_from`, `_reused.<column>`, aligned with the batch; None where none
        was found), and each found row takes what prepare made of it then."""
        base = self.input_base
        if base is None:
            return None
        fields = [r.fields for r in (self.renderer, self.annotator) if r is not None]
        for i in valid:
            w = work[i]
            row = {**rows[i], self.text_column: w.text}
            w.input_key = input_key(base, w.text, [r.value(row, c, sub) for r, names in
                                                   zip((self.renderer, self.annotator), fields) for c, sub in names])
        if not self.shards:
            return None
        from pipeline.reuse.index import REUSED_FROM, REUSED_PREFIX, look_up_inputs

        found = look_up_inputs([w.input_key for w in work], self.shards)
        if found is None:
            return None
        prepared = [c for c in found.column_names if c.startswith(REUSED_PREFIX)]
        earlier = found.select(prepared).to_pylist()
        for i, source in enumerate(found.column(REUSED_FROM).to_pylist()):
            if source is not None:
                w = work[i]
                w.earlier = e = {c[len(REUSED_PREFIX):]: v for c, v in earlier[i].items()}
                w.prompt_tokens, w.truncated, w.original_tokens = e["prompt_tokens"], e["truncated"], e["original_tokens"]
        return found

    def _hold(self, rows: int) -> None:
        """The hold drill (`debug.hold_input_until_output_s`): past the first rows, wait for
        the run's first committed part, as input that arrives while generation runs would."""
        s = self.settings
        self._rows_seen = getattr(self, "_rows_seen", 0) + rows
        if s.hold_until is None or self._rows_seen <= s.hold_after_rows:
            return
        deadline = time.monotonic() + s.hold_s
        while time.monotonic() < deadline and not (os.path.isdir(s.hold_until) and os.listdir(s.hold_until)):
            time.sleep(0.2)
        self.settings = replace(s, hold_until=None)  # released once: the rest is read as it comes

    def _fit_long_rows(self, rows: list[dict[str, Any]], work: list[_Row], valid: list[int]) -> None:
        """3. Rows past the smallest limit may be too long; for those only, measure what the
        template adds around the text (its other fields vary by row), then truncate, chunk
        or skip them, as the job says."""
        limits = [self.max_prompt_tokens, self.max_text_tokens, self.cap_prompt_tokens]
        smallest = min(x for x in limits if x is not None)
        long_rows = [i for i in valid if len(work[i].ids) > smallest]
        overhead = dict(zip(long_rows, (len(x) for x in self.encode([self.render(rows[i], "") for i in long_rows]))))
        for i in long_rows:
            w = work[i]
            text_tokens = len(w.ids) - overhead[i]
            room = self.max_prompt_tokens - overhead[i]
            if self.cap_prompt_tokens is not None:
                room = min(room, max(1, self.cap_prompt_tokens - overhead[i]))
            cap = min(room, self.max_text_tokens) if self.max_text_tokens is not None else room
            if len(w.ids) <= self.max_prompt_tokens and text_tokens <= cap:
                continue
            if room < 1:
                w.fail(Status.ERROR, f"the prompt template alone is {overhead[i]} tokens; the context fits "
                                     f"{self.max_prompt_tokens} with {self.max_new_tokens} left to generate")
            elif self.length.policy == "skip":
                w.original_tokens = len(w.ids)
                w.fail(Status.SKIPPED_TOO_LONG, f"prompt is {len(w.ids)} tokens; the limit is "
                                                f"{min(self.max_prompt_tokens, overhead[i] + cap)}")
            elif self.length.policy == "truncate":
                self._truncate(rows[i], w, cap)
            else:
                self._chunk(w, cap, overhead[i])

    def _annotation_prompts(self, rows: list[dict[str, Any]], work: list[_Row], valid: list[int]) -> None:
        """4. The annotation prompt, over the same (possibly truncated) text."""
        assert self.annotator is not None
        todo = [i for i in valid if work[i].status == Status.OK and work[i].chunk_texts is None]
        texts = [work[i].prompt_text or work[i].text for i in todo]
        prompts = [self.annotator.render({**rows[i], self.text_column: t}) for i, t in zip(todo, texts)]
        for i, ids in zip(todo, self.encode(prompts)):
            w = work[i]
            if len(ids) > self.max_annotation_prompt:
                w.fail(Status.ERROR, f"the annotation prompt is {len(ids)} tokens; the context fits "
                                     f"{self.max_annotation_prompt} with annotations.max_new_tokens left")
                continue
            w.annotation_ids = ids
            w.bucket_tokens = max(w.bucket_tokens, len(ids))

    def _columns(self, work: list[_Row]) -> dict[str, pa.Array]:
        """5. The columns this stage adds, bucket included; a row never tokenized has no
        bucket (index 0 only orders it)."""
        index = [self.bucketer.names.index(w.earlier["bucket"]) if w.earlier is not None
                 else self.bucketer.index(w.bucket_tokens) for w in work]
        columns: dict[str, pa.Array] = {
            "prompt_tokens": pa.array([w.prompt_tokens for w in work], pa.int32()),
            "truncated": pa.array([w.truncated for w in work], pa.bool_()),
            "original_tokens": pa.array([w.original_tokens for w in work], pa.int32()),
            "chunks": pa.array([w.earlier["chunks"] if w.earlier is not None
                                else len(w.chunk_texts) if w.chunk_texts else None for w in work], pa.int32()),
            "bucket": pa.array([self.bucketer.names[k] if w.prompt_tokens is not None else None
                                for k, w in zip(index, work)], pa.string()),
            "status": pa.array([w.status for w in work], pa.string()),
            "error": pa.array([w.error for w in work], pa.string()),
            "notes": pa.array([w.notes for w in work], pa.string()),
            schema.BUCKET_INDEX: pa.array(index, pa.int32()),
            schema.PROMPT_TOKEN_IDS: pa.array([w.ids for w in work], pa.list_(pa.int32())),
            schema.CHUNK_TEXTS: pa.array([w.chunk_texts for w in work], pa.list_(pa.string())),
        }
        if self.annotator is not None:
            columns[schema.ANNOTATION_TOKEN_IDS] = pa.array([w.annotation_ids for w in work], pa.list_(pa.int32()))
        columns[schema.PREPARED_AT] = pa.array([time.time()] * len(work), pa.float64())
        if self.settings.input_key_base is not None:  # rows that came out of prepare ok have one
            columns["input_key"] = pa.array([w.input_key if w.status == Status.OK else None for w in work], pa.string())
        return columns

    def text_tokens(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A row's text alone, as plain text (what the prompt holds of it), with character offsets."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        return enc["input_ids"], enc["offset_mapping"]

    def _truncate(self, row: dict[str, Any], w: _Row, cap: int) -> None:
        """Keep `cap` tokens of the text; re-tokenizing a cut can merge differently,
        so shrink by the excess until the rendered prompt fits."""
        ids, _ = self.text_tokens(w.text)
        w.original_tokens = len(w.ids)
        for _ in range(4):
            kept = truncate_ids(ids, cap, self.length.keep)
            if self.length.keep == "head_tail" and len(ids) > cap:
                head = (cap + 1) // 2
                text = self.tokenizer.decode(kept[:head]) + " … " + self.tokenizer.decode(kept[head:])
            else:
                text = self.tokenizer.decode(kept)
            prompt = self.encode([self.render(row, text)])[0]
            limit = self.max_prompt_tokens
            if self.cap_prompt_tokens is not None:
                limit = min(limit, max(self.cap_prompt_tokens, len(prompt) - len(kept) + 1))
            excess = len(prompt) - limit
            if excess <= 0 and (self.max_text_tokens is None or len(kept) <= self.max_text_tokens):
                w.ids, w.truncated, w.prompt_text = prompt, True, text
                w.prompt_tokens = w.bucket_tokens = len(prompt)
                return
            cap -= max(excess, 1) + 1
            if cap < 1:
                break
        w.fail(Status.ERROR, f"could not truncate the prompt ({w.original_tokens} tokens) to fit")

    def _chunk(self, w: _Row, cap: int, overhead: int) -> None:
        """Cut the text into windows of `cap` tokens for map-reduce summarization."""
        ids, offsets = self.text_tokens(w.text)
        overlap = min(self.length.chunk_overlap, cap // 4)
        spans = windows(offsets, w.text, cap, overlap)
        w.chunk_texts = [w.text[a:b] for a, b in (char_span(offsets, s, e) for s, e in spans)]
        w.original_tokens = len(w.ids)
        w.ids = []
        w.bucket_tokens = overhead + max(e - s for s, e in spans)
