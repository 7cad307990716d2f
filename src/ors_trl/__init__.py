"""ors-trl: train language models with TRL's GRPOTrainer against Open Reward Standard environments.

The public API is the list below; every other module is private. Importing the package is light:
torch, trl, transformers, datasets and the openreward SDK are imported only when a feature that
needs them is first used.
"""

from ._adapter import OpenRewardEnvironment
from ._budget import get_max_sessions, set_max_sessions
from ._client import AsyncClient, AsyncSession, Client, Session
from ._engine import RolloutEngine
from ._eval import EvalReport, LocalPolicy, OpenAIPolicy
from ._exceptions import (
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConfigurationError,
    EnvironmentNotFoundError,
    MissingAPIKeyError,
    NotFoundError,
    ORSError,
    ORSTimeoutError,
    PaymentRequiredError,
    ProtocolError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    SessionExpiredError,
    StreamInterruptedError,
    ToolError,
    ToolFailedError,
    ToolRefusedError,
    TransportError,
)
from ._metrics import EnvMetrics
from ._mix import OpenRewardMix
from ._records import EpisodeRecorder
from ._spec import OpenRewardSpec, outcome_reward
from ._transport import RetryPolicy, Timeouts
from ._types import ImageBlock, Split, TextBlock, ToolList, ToolResult, ToolSpec, UnknownBlock
from ._version import __version__

__all__ = [
    "APIStatusError",
    "AsyncClient",
    "AsyncSession",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConfigurationError",
    "EnvMetrics",
    "EnvironmentNotFoundError",
    "EpisodeRecorder",
    "EvalReport",
    "ImageBlock",
    "LocalPolicy",
    "MissingAPIKeyError",
    "NotFoundError",
    "ORSError",
    "ORSTimeoutError",
    "OpenAIPolicy",
    "OpenRewardEnvironment",
    "OpenRewardMix",
    "OpenRewardSpec",
    "PaymentRequiredError",
    "ProtocolError",
    "RateLimitError",
    "RetryPolicy",
    "RolloutEngine",
    "ServerError",
    "ServiceUnavailableError",
    "Session",
    "SessionExpiredError",
    "Split",
    "StreamInterruptedError",
    "TextBlock",
    "Timeouts",
    "ToolError",
    "ToolFailedError",
    "ToolList",
    "ToolRefusedError",
    "ToolResult",
    "ToolSpec",
    "TransportError",
    "UnknownBlock",
    "__version__",
    "get_max_sessions",
    "outcome_reward",
    "set_max_sessions",
]
