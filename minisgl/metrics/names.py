"""The stable metric names of ARCHITECTURE.md ("Metrics"); dashboards and rules use these."""

PREFIX = "minisgl_"

# Histograms.
TTFT = "minisgl_time_to_first_token_seconds"
TPOT = "minisgl_time_per_output_token_seconds"
ITL = "minisgl_inter_token_latency_seconds"
E2E = "minisgl_e2e_request_latency_seconds"
QUEUE_TIME = "minisgl_request_queue_time_seconds"
BATCH_SIZE = "minisgl_batch_size"
SPEC_ACCEPT_LENGTH = "minisgl_spec_accept_length"

# Gauges.
NUM_RUNNING = "minisgl_num_requests_running"
NUM_WAITING = "minisgl_num_requests_waiting"
KV_USAGE = "minisgl_kv_cache_usage_ratio"
KV_PAGES = "minisgl_kv_cache_pages"
# What the server runs (set once at start): info (value 1, the facts in its labels), and bytes.
MODEL_INFO = "minisgl_model_info"
WEIGHT_BYTES = "minisgl_model_weight_bytes"

# Counters (as exposed, with the _total suffix).
PROMPT_TOKENS = "minisgl_prompt_tokens_total"
GENERATION_TOKENS = "minisgl_generation_tokens_total"
PREFIX_CACHE_HIT_TOKENS = "minisgl_prefix_cache_hit_tokens_total"
PREEMPTIONS = "minisgl_preemptions_total"
REQUESTS = "minisgl_requests_total"
SPEC_DRAFT_TOKENS = "minisgl_spec_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "minisgl_spec_accepted_tokens_total"

HISTOGRAMS = (TTFT, TPOT, ITL, E2E, QUEUE_TIME, BATCH_SIZE, SPEC_ACCEPT_LENGTH)
GAUGES = (NUM_RUNNING, NUM_WAITING, KV_USAGE, KV_PAGES, MODEL_INFO, WEIGHT_BYTES)
COUNTERS = (
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_HIT_TOKENS,
    PREEMPTIONS,
    REQUESTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
)

FINISH_REASONS = ("stop", "length", "abort", "error")
KV_PAGE_STATES = ("free", "used", "cached")
