from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Whitespace(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WHITESPACE_DEFAULT: _ClassVar[Whitespace]
    WHITESPACE_FLEXIBLE: _ClassVar[Whitespace]
    WHITESPACE_COMPACT: _ClassVar[Whitespace]

class GrammarState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_STATE_UNSPECIFIED: _ClassVar[GrammarState]
    GRAMMAR_STATE_COMPILING: _ClassVar[GrammarState]
    GRAMMAR_STATE_READY: _ClassVar[GrammarState]
    GRAMMAR_STATE_FAILED: _ClassVar[GrammarState]

class SeqStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQ_STATUS_UNSPECIFIED: _ClassVar[SeqStatus]
    SEQ_STATUS_READY: _ClassVar[SeqStatus]
    SEQ_STATUS_WAITING: _ClassVar[SeqStatus]
    SEQ_STATUS_FAILED: _ClassVar[SeqStatus]
    SEQ_STATUS_FINISHED: _ClassVar[SeqStatus]
    SEQ_STATUS_CLOSED: _ClassVar[SeqStatus]
    SEQ_STATUS_ERROR: _ClassVar[SeqStatus]

class RowEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_ENCODING_DENSE: _ClassVar[RowEncoding]
    ROW_ENCODING_ALLOWED_IDS: _ClassVar[RowEncoding]
    ROW_ENCODING_REJECTED_IDS: _ClassVar[RowEncoding]
    ROW_ENCODING_DICT_REF: _ClassVar[RowEncoding]
WHITESPACE_DEFAULT: Whitespace
WHITESPACE_FLEXIBLE: Whitespace
WHITESPACE_COMPACT: Whitespace
GRAMMAR_STATE_UNSPECIFIED: GrammarState
GRAMMAR_STATE_COMPILING: GrammarState
GRAMMAR_STATE_READY: GrammarState
GRAMMAR_STATE_FAILED: GrammarState
SEQ_STATUS_UNSPECIFIED: SeqStatus
SEQ_STATUS_READY: SeqStatus
SEQ_STATUS_WAITING: SeqStatus
SEQ_STATUS_FAILED: SeqStatus
SEQ_STATUS_FINISHED: SeqStatus
SEQ_STATUS_CLOSED: SeqStatus
SEQ_STATUS_ERROR: SeqStatus
ROW_ENCODING_DENSE: RowEncoding
ROW_ENCODING_ALLOWED_IDS: RowEncoding
ROW_ENCODING_REJECTED_IDS: RowEncoding
ROW_ENCODING_DICT_REF: RowEncoding
CONTRACT_FIELD_NUMBER: _ClassVar[int]
contract: _descriptor.FieldDescriptor

class Contract(_message.Message):
    __slots__ = ("session_metadata_key", "auth_metadata_key", "auth_scheme", "revision", "status_mask", "accepting_bit", "resample_bit")
    SESSION_METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    AUTH_METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    AUTH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    STATUS_MASK_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_BIT_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_BIT_FIELD_NUMBER: _ClassVar[int]
    session_metadata_key: str
    auth_metadata_key: str
    auth_scheme: str
    revision: int
    status_mask: int
    accepting_bit: int
    resample_bit: int
    def __init__(self, session_metadata_key: _Optional[str] = ..., auth_metadata_key: _Optional[str] = ..., auth_scheme: _Optional[str] = ..., revision: _Optional[int] = ..., status_mask: _Optional[int] = ..., accepting_bit: _Optional[int] = ..., resample_bit: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("server_version", "backend", "backend_version", "tokenizer", "vocab_size", "logits_width", "words_per_row", "tokenizer_fingerprint", "eos_token_ids", "max_message_bytes", "max_rows_per_step", "row_encodings", "row_dictionary_size", "contract_revision", "max_tokens_per_step", "max_draft_tokens", "max_sequences_per_session", "row_compression", "json_schema_mode")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_WIDTH_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    ROW_ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    ROW_DICTIONARY_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_REVISION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    ROW_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_MODE_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    backend: str
    backend_version: str
    tokenizer: str
    vocab_size: int
    logits_width: int
    words_per_row: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_message_bytes: int
    max_rows_per_step: int
    row_encodings: _containers.RepeatedScalarFieldContainer[RowEncoding]
    row_dictionary_size: int
    contract_revision: int
    max_tokens_per_step: int
    max_draft_tokens: int
    max_sequences_per_session: int
    row_compression: str
    json_schema_mode: str
    def __init__(self, server_version: _Optional[str] = ..., backend: _Optional[str] = ..., backend_version: _Optional[str] = ..., tokenizer: _Optional[str] = ..., vocab_size: _Optional[int] = ..., logits_width: _Optional[int] = ..., words_per_row: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_message_bytes: _Optional[int] = ..., max_rows_per_step: _Optional[int] = ..., row_encodings: _Optional[_Iterable[_Union[RowEncoding, str]]] = ..., row_dictionary_size: _Optional[int] = ..., contract_revision: _Optional[int] = ..., max_tokens_per_step: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., max_sequences_per_session: _Optional[int] = ..., row_compression: _Optional[str] = ..., json_schema_mode: _Optional[str] = ...) -> None: ...

class GrammarOptions(_message.Message):
    __slots__ = ("whitespace", "reasoning_start", "reasoning_end", "max_whitespace")
    WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_FIELD_NUMBER: _ClassVar[int]
    MAX_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    whitespace: Whitespace
    reasoning_start: str
    reasoning_end: str
    max_whitespace: int
    def __init__(self, whitespace: _Optional[_Union[Whitespace, str]] = ..., reasoning_start: _Optional[str] = ..., reasoning_end: _Optional[str] = ..., max_whitespace: _Optional[int] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolFunction(_message.Message):
    __slots__ = ("name", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCalls(_message.Message):
    __slots__ = ("tools", "defs", "single")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    DEFS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolFunction]
    defs: str
    single: bool
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolFunction, _Mapping]]] = ..., defs: _Optional[str] = ..., single: _Optional[bool] = ...) -> None: ...

class Template(_message.Message):
    __slots__ = ("schema", "arguments")
    class ArgumentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    schema: str
    arguments: _containers.ScalarMap[str, str]
    def __init__(self, schema: _Optional[str] = ..., arguments: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GrammarSpec(_message.Message):
    __slots__ = ("json_schema", "regex", "lark", "ebnf", "choice", "structural_tag", "tool_calls", "template", "options")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark: str
    ebnf: str
    choice: ChoiceList
    structural_tag: str
    tool_calls: ToolCalls
    template: Template
    options: GrammarOptions
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., ebnf: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., structural_tag: _Optional[str] = ..., tool_calls: _Optional[_Union[ToolCalls, _Mapping]] = ..., template: _Optional[_Union[Template, _Mapping]] = ..., options: _Optional[_Union[GrammarOptions, _Mapping]] = ...) -> None: ...

class RegisterGrammarRequest(_message.Message):
    __slots__ = ("spec", "wait", "backend", "tokenizer_fingerprint")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    spec: GrammarSpec
    wait: bool
    backend: str
    tokenizer_fingerprint: str
    def __init__(self, spec: _Optional[_Union[GrammarSpec, _Mapping]] = ..., wait: _Optional[bool] = ..., backend: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...

class RegisterGrammarResponse(_message.Message):
    __slots__ = ("grammar_id", "state", "error", "compile_seconds")
    GRAMMAR_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grammar_id: str
    state: GrammarState
    error: str
    compile_seconds: float
    def __init__(self, grammar_id: _Optional[str] = ..., state: _Optional[_Union[GrammarState, str]] = ..., error: _Optional[str] = ..., compile_seconds: _Optional[float] = ...) -> None: ...

class SeqStep(_message.Message):
    __slots__ = ("seq_id", "step", "tokens", "draft_tokens", "grammar_id", "spec", "close", "rollback", "history_offset", "propose_drafts", "sampled_unmasked")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    HISTORY_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_UNMASKED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    step: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    grammar_id: str
    spec: GrammarSpec
    close: bool
    rollback: int
    history_offset: int
    propose_drafts: int
    sampled_unmasked: bool
    def __init__(self, seq_id: _Optional[str] = ..., step: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., grammar_id: _Optional[str] = ..., spec: _Optional[_Union[GrammarSpec, _Mapping]] = ..., close: _Optional[bool] = ..., rollback: _Optional[int] = ..., history_offset: _Optional[int] = ..., propose_drafts: _Optional[int] = ..., sampled_unmasked: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("seqs", "want_forced_tokens", "handles", "steps", "token_counts", "tokens", "columnar_sampled_unmasked")
    SEQS_FIELD_NUMBER: _ClassVar[int]
    WANT_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_SAMPLED_UNMASKED_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[SeqStep]
    want_forced_tokens: bool
    handles: bytes
    steps: bytes
    token_counts: bytes
    tokens: bytes
    columnar_sampled_unmasked: bool
    def __init__(self, seqs: _Optional[_Iterable[_Union[SeqStep, _Mapping]]] = ..., want_forced_tokens: _Optional[bool] = ..., handles: _Optional[bytes] = ..., steps: _Optional[bytes] = ..., token_counts: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., columnar_sampled_unmasked: _Optional[bool] = ...) -> None: ...

class SeqResult(_message.Message):
    __slots__ = ("seq_id", "step", "status", "code", "reason", "forced_tokens", "first_row", "num_rows", "drafts_valid", "accepting", "handle", "proposed_drafts", "resample")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_VALID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    step: int
    status: SeqStatus
    code: int
    reason: str
    forced_tokens: _containers.RepeatedScalarFieldContainer[int]
    first_row: int
    num_rows: int
    drafts_valid: int
    accepting: bool
    handle: int
    proposed_drafts: _containers.RepeatedScalarFieldContainer[int]
    resample: bool
    def __init__(self, seq_id: _Optional[str] = ..., step: _Optional[int] = ..., status: _Optional[_Union[SeqStatus, str]] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., forced_tokens: _Optional[_Iterable[int]] = ..., first_row: _Optional[int] = ..., num_rows: _Optional[int] = ..., drafts_valid: _Optional[int] = ..., accepting: _Optional[bool] = ..., handle: _Optional[int] = ..., proposed_drafts: _Optional[_Iterable[int]] = ..., resample: _Optional[bool] = ...) -> None: ...

class EntryProblem(_message.Message):
    __slots__ = ("index", "code", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    reason: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "words_per_row", "server_seconds", "statuses", "problems", "forced_counts", "forced_tokens", "num_rows", "row_block")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    FORCED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BLOCK_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SeqResult]
    words_per_row: int
    server_seconds: float
    statuses: bytes
    problems: _containers.RepeatedCompositeFieldContainer[EntryProblem]
    forced_counts: bytes
    forced_tokens: bytes
    num_rows: int
    row_block: bytes
    def __init__(self, results: _Optional[_Iterable[_Union[SeqResult, _Mapping]]] = ..., words_per_row: _Optional[int] = ..., server_seconds: _Optional[float] = ..., statuses: _Optional[bytes] = ..., problems: _Optional[_Iterable[_Union[EntryProblem, _Mapping]]] = ..., forced_counts: _Optional[bytes] = ..., forced_tokens: _Optional[bytes] = ..., num_rows: _Optional[int] = ..., row_block: _Optional[bytes] = ...) -> None: ...
