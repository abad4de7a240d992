from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_PREFILLED: _ClassVar[Stage]
    STAGE_DECODING: _ClassVar[Stage]
    STAGE_FINISHED: _ClassVar[Stage]
    STAGE_FAILED: _ClassVar[Stage]
STAGE_UNSPECIFIED: Stage
STAGE_PREFILLED: Stage
STAGE_DECODING: Stage
STAGE_FINISHED: Stage
STAGE_FAILED: Stage

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "prompt_text", "slo_class", "max_tokens", "exclude_prefill", "bind_decode_late")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    BIND_DECODE_LATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    prompt_text: str
    slo_class: str
    max_tokens: int
    exclude_prefill: _containers.RepeatedScalarFieldContainer[str]
    bind_decode_late: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., prompt_text: _Optional[str] = ..., slo_class: _Optional[str] = ..., max_tokens: _Optional[int] = ..., exclude_prefill: _Optional[_Iterable[str]] = ..., bind_decode_late: _Optional[bool] = ...) -> None: ...

class BindDecodeRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("name", "url")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("request_id", "prefill", "decode", "policy", "slo_class", "predicted_output_tokens", "predicted_ttft_s", "predicted_tpot_s", "slo_feasible", "guarded", "fallback", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    SLO_FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    GUARDED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill: Endpoint
    decode: Endpoint
    policy: str
    slo_class: str
    predicted_output_tokens: float
    predicted_ttft_s: float
    predicted_tpot_s: float
    slo_feasible: bool
    guarded: bool
    fallback: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prefill: _Optional[_Union[Endpoint, _Mapping]] = ..., decode: _Optional[_Union[Endpoint, _Mapping]] = ..., policy: _Optional[str] = ..., slo_class: _Optional[str] = ..., predicted_output_tokens: _Optional[float] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_tpot_s: _Optional[float] = ..., slo_feasible: _Optional[bool] = ..., guarded: _Optional[bool] = ..., fallback: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("request_id", "stage", "output_tokens", "ttft_s", "tpot_s", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stage: Stage
    output_tokens: int
    ttft_s: float
    tpot_s: float
    error: str
    def __init__(self, request_id: _Optional[str] = ..., stage: _Optional[_Union[Stage, str]] = ..., output_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class GetPoolSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceState(_message.Message):
    __slots__ = ("name", "role", "url", "healthy", "running", "waiting", "kv_tokens_used", "kv_capacity_tokens", "inflight", "queued", "queued_tokens", "remaining_output_tokens", "profile_name", "profile_quality", "profile_age_s", "profile_trusted", "last_scrape_age_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_NAME_FIELD_NUMBER: _ClassVar[int]
    PROFILE_QUALITY_FIELD_NUMBER: _ClassVar[int]
    PROFILE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PROFILE_TRUSTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SCRAPE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    url: str
    healthy: bool
    running: int
    waiting: int
    kv_tokens_used: int
    kv_capacity_tokens: int
    inflight: int
    queued: int
    queued_tokens: int
    remaining_output_tokens: float
    profile_name: str
    profile_quality: str
    profile_age_s: float
    profile_trusted: bool
    last_scrape_age_s: float
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., url: _Optional[str] = ..., healthy: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., inflight: _Optional[int] = ..., queued: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., remaining_output_tokens: _Optional[float] = ..., profile_name: _Optional[str] = ..., profile_quality: _Optional[str] = ..., profile_age_s: _Optional[float] = ..., profile_trusted: _Optional[bool] = ..., last_scrape_age_s: _Optional[float] = ...) -> None: ...

class PoolSnapshot(_message.Message):
    __slots__ = ("policy", "prefill", "decode", "inflight", "traffic_heterogeneity")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_HETEROGENEITY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    prefill: _containers.RepeatedCompositeFieldContainer[InstanceState]
    decode: _containers.RepeatedCompositeFieldContainer[InstanceState]
    inflight: int
    traffic_heterogeneity: float
    def __init__(self, policy: _Optional[str] = ..., prefill: _Optional[_Iterable[_Union[InstanceState, _Mapping]]] = ..., decode: _Optional[_Iterable[_Union[InstanceState, _Mapping]]] = ..., inflight: _Optional[int] = ..., traffic_heterogeneity: _Optional[float] = ...) -> None: ...
