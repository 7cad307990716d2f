"""ors-trl: train language models with TRL's GRPOTrainer against Open Reward Standard environments.

The public API is the list below: what a user constructs, calls or catches, and the types users receive (from the
client, `adapter.episode` and `rollout_func.last_episodes` (`Episode`), `spec.metrics` (`EnvMetrics`), the episode
logs (`EpisodeRecord`) and `write_report` (`ReportSummary`)). Every other module is private. Importing the package is
light: torch, trl, transformers, datasets and the openreward SDK are imported only when a feature that needs them is
first used.
"""

from ._version import __version__
from .core.episode import Episode
from .core.metrics import EnvMetrics
from .core.records import EpisodeRecord
from .evaluation.policies import LocalPolicy, OpenAIPolicy, Policy, PolicyReply, RandomPolicy
from .evaluation.runner import EvalReport, MixEvalReport
from .harness import Endpoint, Harness
from .mix import OpenRewardMix
from .protocol.budget import get_max_sessions, set_max_sessions
from .protocol.client import AsyncClient, AsyncSession, Client, ClientOptions, Session
from .protocol.errors import (
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConfigurationError,
    ContextLengthExceeded,
    EnvironmentNotFoundError,
    ImageError,
    MissingAPIKeyError,
    MissingExtraError,
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
from .protocol.transport import RetryPolicy, Timeouts
from .protocol.types import (
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
from .report import ReportSummary, write_report
from .spec import OpenRewardSpec
from .tasks.difficulty import PlatformDifficulty
from .tasks.sampling import AdaptiveSampler, TaskSampler, UniformSampler
from .trl.rewards import outcome_reward

__all__ = [
    "APIStatusError", "AdaptiveSampler", "AsyncClient", "AsyncSession", "AuthenticationError", "BadRequestError",
    "Client", "ClientOptions", "ConfigurationError", "ContextLengthExceeded", "Endpoint", "EnvMetrics",
    "EnvironmentNotFoundError", "Episode", "EpisodeRecord", "EvalReport", "GroupScore", "Harness", "ImageBlock",
    "ImageError", "LocalPolicy", "Message", "MissingAPIKeyError", "MissingExtraError", "MixEvalReport",
    "NotFoundError", "ORSError", "ORSTimeoutError", "OpenAIPolicy", "OpenRewardMix", "OpenRewardSpec",
    "PaymentRequiredError", "PlatformDifficulty", "Policy", "PolicyError", "PolicyReply", "ProtocolError",
    "RandomPolicy", "RateLimitError", "ReasoningBlock", "ReportSummary", "RetryPolicy", "ServerError",
    "ServiceUnavailableError", "Session", "SessionExpiredError", "Split", "StreamInterruptedError", "TaskSampler",
    "TerminalTool", "TextBlock", "Timeouts", "ToolCallBlock", "ToolError", "ToolFailedError", "ToolList",
    "ToolRefusedError", "ToolResult", "ToolResultBlock", "ToolSpec", "TransportError", "UniformSampler",
    "UnknownBlock", "UsageError", "__version__", "get_max_sessions", "outcome_reward", "set_max_sessions",
    "write_report"
]
