from service.grpc_api import tei_pb2 as _tei_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbedMultiRequest(_message.Message):
    __slots__ = ("inputs", "is_query", "truncate", "truncation_direction", "embedding_dtype", "model")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    IS_QUERY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    is_query: bool
    truncate: bool
    truncation_direction: _tei_pb2.TruncationDirection
    embedding_dtype: str
    model: str
    def __init__(self, inputs: _Optional[str] = ..., is_query: _Optional[bool] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[_tei_pb2.TruncationDirection, str]] = ..., embedding_dtype: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EmbedMultiResponse(_message.Message):
    __slots__ = ("token_embeddings", "metadata", "embedding_dtype")
    TOKEN_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    token_embeddings: _containers.RepeatedCompositeFieldContainer[_tei_pb2.TokenEmbedding]
    metadata: _tei_pb2.Metadata
    embedding_dtype: str
    def __init__(self, token_embeddings: _Optional[_Iterable[_Union[_tei_pb2.TokenEmbedding, _Mapping]]] = ..., metadata: _Optional[_Union[_tei_pb2.Metadata, _Mapping]] = ..., embedding_dtype: _Optional[str] = ...) -> None: ...

class EmbedHybridRequest(_message.Message):
    __slots__ = ("inputs", "outputs", "normalize", "truncate", "truncation_direction", "prompt_name", "model")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    outputs: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    truncate: bool
    truncation_direction: _tei_pb2.TruncationDirection
    prompt_name: str
    model: str
    def __init__(self, inputs: _Optional[str] = ..., outputs: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[_tei_pb2.TruncationDirection, str]] = ..., prompt_name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EmbedHybridResponse(_message.Message):
    __slots__ = ("dense", "sparse", "colbert", "metadata")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    COLBERT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    dense: _containers.RepeatedScalarFieldContainer[float]
    sparse: _containers.RepeatedCompositeFieldContainer[_tei_pb2.SparseValue]
    colbert: _containers.RepeatedCompositeFieldContainer[_tei_pb2.TokenEmbedding]
    metadata: _tei_pb2.Metadata
    def __init__(self, dense: _Optional[_Iterable[float]] = ..., sparse: _Optional[_Iterable[_Union[_tei_pb2.SparseValue, _Mapping]]] = ..., colbert: _Optional[_Iterable[_Union[_tei_pb2.TokenEmbedding, _Mapping]]] = ..., metadata: _Optional[_Union[_tei_pb2.Metadata, _Mapping]] = ...) -> None: ...
