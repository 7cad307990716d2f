"""ors-trl: train language models with TRL's GRPOTrainer against Open Reward Standard environments.

The public API is the list below: what a user constructs, calls or catches, and the types users receive (from the
client, `adapter.episode` and `rollout_func.last_episodes` (`Episode`), `spec.metrics` (`EnvMetrics`), the episode
logs (`EpisodeRecord`) and `write_report` (`ReportSummary`)). Every other module is private. Importing the package is
light: torch, trl, transformers, datasets and the openreward SDK are imported only when a feature that needs them is
first used.
"""

from ._budget import get_max_sessions, set_max_sessions
from ._client import AsyncClient, AsyncSession, Client, Session
from ._difficulty import PlatformDifficulty
from ._episode import Episode
from ._eval import EvalReport, MixEvalReport
from ._exceptions import (
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConfigurationError,
    ContextLengthExceeded,
    EnvironmentNotFoundError,
    ImageError,
    MissingAPIKeyError,
    NotFoundError,
    ORSError,
    ORSTimeoutError,
    PaymentRequiredError,
    PolicyError,
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
    UsageError,
)
from ._metrics import EnvMetrics
from ._mix import OpenRewardMix
from ._policies import LocalPolicy, OpenAIPolicy, Policy, PolicyReply
from ._records import EpisodeRecord
from ._report import ReportSummary, write_report
from ._rewards import outcome_reward
from ._sampling import AdaptiveSampler, TaskSampler, UniformSampler
from ._spec import OpenRewardSpec
from ._transport import RetryPolicy, Timeouts
from ._types import (
    GroupScore,
    ImageBlock,
    Message,
    ReasoningBlock,
    Split,
    TerminalTool,
    TextBlock,
    ToolCallBlock,
    ToolList,
    ToolResult,
    ToolResultBlock,
    ToolSpec,
    UnknownBlock,
)
from ._version import __version__

__all__ = [
    "APIStatusError",
    "AdaptiveSampler",
    "AsyncClient",
    "AsyncSession",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConfigurationError",
    "ContextLengthExceeded",
    "EnvMetrics",
    "EnvironmentNotFoundError",
    "Episode",
    "EpisodeRecord",
    "EvalReport",
    "GroupScore",
    "ImageBlock",
    "ImageError",
    "LocalPolicy",
    "Message",
    "MissingAPIKeyError",
    "MixEvalReport",
    "NotFoundError",
    "ORSError",
    "ORSTimeoutError",
    "OpenAIPolicy",
    "OpenRewardMix",
    "OpenRewardSpec",
    "PaymentRequiredError",
    "PlatformDifficulty",
    "Policy",
    "PolicyError",
    "PolicyReply",
    "ProtocolError",
    "RateLimitError",
    "ReasoningBlock",
    "ReportSummary",
    "RetryPolicy",
    "ServerError",
    "ServiceUnavailableError",
    "Session",
    "SessionExpiredError",
    "Split",
    "StreamInterruptedError",
    "TaskSampler",
    "TerminalTool",
    "TextBlock",
    "Timeouts",
    "ToolCallBlock",
    "ToolError",
    "ToolFailedError",
    "ToolList",
    "ToolRefusedError",
    "ToolResult",
    "ToolResultBlock",
    "ToolSpec",
    "TransportError",
    "UniformSampler",
    "UnknownBlock",
    "UsageError",
    "__version__",
    "get_max_sessions",
    "outcome_reward",
    "set_max_sessions",
    "write_report",
]
