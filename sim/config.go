package sim

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// Group is one KV-cache group of the simulated engine.
type Group struct {
	// Kind is messages.KindFull, KindSlidingWindow or KindEagle.
	Kind string `json:"kind"`
	// TokensPerBlock is the group's block size in tokens (vLLM's block_size).
	TokensPerBlock int `json:"tokens_per_block"`
	// SlidingWindow is the window in tokens (sliding_window groups only).
	SlidingWindow int `json:"sliding_window,omitempty"`
}

// Config is every setting of one simulated engine. DefaultConfig fills it;
// Validate checks it before Run touches NATS or shared memory.
type Config struct {
	// Engine is the engine id: [A-Za-z0-9_-]{1,64} (PROTOCOL.md "Words").
	Engine string `json:"engine"`
	// Prefix is the subject prefix P (default "kvactors").
	Prefix string `json:"prefix"`
	// ShmDir is where the engine creates its shm segments; it must be the
	// node's shm directory. Segments are removed when Run returns.
	ShmDir string `json:"shm_dir"`

	// TokensPerHash is the prefix-cache hash granularity (default 4).
	TokensPerHash int `json:"tokens_per_hash"`
	// BlocksPerChunk is GPU blocks per offloaded chunk (default 2).
	BlocksPerChunk int `json:"blocks_per_chunk"`
	// Groups are the KV-cache groups (default: one full and one
	// sliding_window group with a 64-token window, 16 tokens per block).
	// Every group's tokens_per_block * BlocksPerChunk must be a multiple of
	// TokensPerHash.
	Groups []Group `json:"groups"`
	// RegionsPerGroup is tensors (layers) per group (default 2).
	RegionsPerGroup int `json:"regions_per_group"`
	// BlockBytes is one block of one region, in bytes (default 4 KiB).
	BlockBytes int64 `json:"block_bytes"`
	// NumGPUBlocks is block ids per group, including the null block 0 and
	// the VerifyBlocks scratch blocks (default 2048). Fewer blocks mean more
	// preemption.
	NumGPUBlocks int `json:"num_gpu_blocks"`
	// VerifyBlocks are the highest block ids of every group, kept out of the
	// scheduler and used only as load targets by the final check (default
	// 128; a multiple of BlocksPerChunk).
	VerifyBlocks int `json:"verify_blocks"`

	// Requests is how many requests the engine serves before it stops
	// (default 100).
	Requests int `json:"requests"`
	// ArrivalsPerStep is the mean number of requests arriving per step
	// (default 0.5). Fewer arrivals make a longer, less loaded run.
	ArrivalsPerStep float64 `json:"arrivals_per_step"`
	// MaxRunning bounds requests scheduled at once (vLLM's max_num_seqs;
	// default 32).
	MaxRunning int `json:"max_running"`
	// StepTokens is the token budget of one step (vLLM's
	// max_num_batched_tokens; default 2048).
	StepTokens int `json:"step_tokens"`
	// PrefillChunk bounds one request's prefill tokens per step (chunked
	// prefill; default 512).
	PrefillChunk int `json:"prefill_chunk"`
	// StepInterval is the scheduler step period (default 2ms).
	StepInterval time.Duration `json:"step_interval"`
	// MinPromptTokens and MaxPromptTokens bound prompt lengths, uniform
	// (default 64..1024).
	MinPromptTokens int `json:"min_prompt_tokens"`
	MaxPromptTokens int `json:"max_prompt_tokens"`
	// MinOutputTokens and MaxOutputTokens bound decode lengths, uniform
	// (default 8..64).
	MinOutputTokens int `json:"min_output_tokens"`
	MaxOutputTokens int `json:"max_output_tokens"`

	// SharedPrefixes is how many distinct shared prompt prefixes exist
	// (default 4). They depend only on Seed, so engines with the same Seed
	// share them and their keys deduplicate across engines.
	SharedPrefixes int `json:"shared_prefixes"`
	// Namespace is the EngineSpec namespace (PROTOCOL.md "Isolation").
	// Engines of one run share it (default "kvactors-sim"), so their keys
	// deduplicate and their kv_events evictions concern each other; set it
	// to the engine id to keep an engine to itself.
	Namespace string `json:"namespace"`
	// SharedPrefixTokens is the length of each shared prefix (default 256;
	// a prompt that is shorter takes part of it).
	SharedPrefixTokens int `json:"shared_prefix_tokens"`
	// SharedRatio is the fraction of requests that start with a shared
	// prefix (default 0.5).
	SharedRatio float64 `json:"shared_ratio"`
	// QueuedAbortRatio is the fraction of requests aborted while queued,
	// before any block (default 0.05).
	QueuedAbortRatio float64 `json:"queued_abort_ratio"`
	// MidAbortRatio is the fraction aborted during prefill (default 0.05).
	MidAbortRatio float64 `json:"mid_abort_ratio"`
	// PreemptRatio is the fraction preempted once on purpose, at a random
	// point (default 0.1). Block pressure preempts others on top.
	PreemptRatio float64 `json:"preempt_ratio"`
	// ResumeHitRatio is the fraction of resumes that find their earlier
	// tokens in the local prefix cache (default 0.5); the rest recompute
	// from token 0.
	ResumeHitRatio float64 `json:"resume_hit_ratio"`
	// Seed makes the token streams, lengths and ratios deterministic
	// (default 1). The epoch is random per run all the same.
	Seed uint64 `json:"seed"`

	// RequestTimeout bounds each request/reply (register, lookup, load;
	// default 5s).
	RequestTimeout time.Duration `json:"request_timeout"`
	// StallTimeout ends the run with an error when nothing progresses
	// (no token, release or finish) for this long (default 20s).
	StallTimeout time.Duration `json:"stall_timeout"`

	// DropBatches is fault injection: the fraction of event batches the
	// SDK's transport drops at random (client.Config.DropBatch), to show
	// that every loss is recovered by a resync. 0 in production.
	DropBatches float64 `json:"drop_batches"`
	// SDK, if set, is called with the SDK's config just before the engine
	// connects, to add fault injection in tests (client.Config.DropBatch,
	// DropIncoming). Nil in production.
	SDK func(*client.Config) `json:"-"`

	// Log receives the engine's log (default slog.Default()).
	Log *slog.Logger `json:"-"`
	// Tracer, if set, wraps each published batch in a "sim.step" span and
	// sends its W3C trace context in the NATS headers, so kvactors' spans for
	// the batch become its children (PROTOCOL.md). Nil sends no headers.
	Tracer trace.TracerProvider `json:"-"`
	// OnRequestDone is called from Run's goroutine once per request that
	// ends (finished or aborted). Several engines may share one callback,
	// so it must be safe for concurrent use; it must not block.
	OnRequestDone func() `json:"-"`
	// BeforeCheck, if set, is called on Run's goroutine once every request
	// ended and was released, just before the final check. Tests use it to
	// tamper with the pool and see the check fail.
	BeforeCheck func() `json:"-"`
}

// DefaultConfig returns a small engine that runs for a few seconds.
func DefaultConfig() Config {
	return Config{
		Engine:         "sim",
		Prefix:         "kvactors",
		ShmDir:         shm.DefaultDir,
		TokensPerHash:  4,
		BlocksPerChunk: 2,
		Groups: []Group{
			{Kind: messages.KindFull, TokensPerBlock: 16},
			{Kind: messages.KindSlidingWindow, TokensPerBlock: 16, SlidingWindow: 64},
		},
		RegionsPerGroup:    2,
		BlockBytes:         4 << 10,
		NumGPUBlocks:       2048,
		VerifyBlocks:       128,
		Requests:           100,
		ArrivalsPerStep:    0.5,
		MaxRunning:         32,
		StepTokens:         2048,
		PrefillChunk:       512,
		StepInterval:       2 * time.Millisecond,
		MinPromptTokens:    64,
		MaxPromptTokens:    1024,
		MinOutputTokens:    8,
		MaxOutputTokens:    64,
		SharedPrefixes:     4,
		SharedPrefixTokens: 256,
		SharedRatio:        0.5,
		QueuedAbortRatio:   0.05,
		MidAbortRatio:      0.05,
		PreemptRatio:       0.1,
		ResumeHitRatio:     0.5,
		Seed:               1,
		Namespace:          DefaultNamespace,
		RequestTimeout:     5 * time.Second,
		StallTimeout:       20 * time.Second,
	}
}

// DefaultNamespace is the namespace sim engines share unless told otherwise.
const DefaultNamespace = "kvactors-sim"

// ErrConfig wraps every reason Validate rejects a Config.
var ErrConfig = errors.New("sim: bad config")

var engineIDRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// Validate reports the first bad setting.
func (c *Config) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrConfig}, a...)...)
	}
	ratio := func(v float64) bool { return v >= 0 && v <= 1 }
	switch {
	case !engineIDRE.MatchString(c.Engine):
		return bad("engine id %q: want [A-Za-z0-9_-]{1,64}", c.Engine)
	case c.Prefix == "":
		return bad("empty prefix")
	case c.ShmDir == "":
		return bad("empty shm dir")
	case c.TokensPerHash < 1 || c.BlocksPerChunk < 1:
		return bad("tokens_per_hash %d and blocks_per_chunk %d must be >= 1", c.TokensPerHash, c.BlocksPerChunk)
	case len(c.Groups) == 0:
		return bad("no groups")
	case c.RegionsPerGroup < 1 || c.BlockBytes < 1:
		return bad("regions per group %d and block bytes %d must be >= 1", c.RegionsPerGroup, c.BlockBytes)
	case c.VerifyBlocks < c.BlocksPerChunk || c.VerifyBlocks%c.BlocksPerChunk != 0:
		return bad("verify blocks %d: want a positive multiple of blocks_per_chunk %d", c.VerifyBlocks, c.BlocksPerChunk)
	case c.NumGPUBlocks < 1+c.VerifyBlocks+c.BlocksPerChunk:
		return bad("num gpu blocks %d leaves no room beside the null block and %d verify blocks", c.NumGPUBlocks, c.VerifyBlocks)
	case c.Requests < 1:
		return bad("requests %d < 1", c.Requests)
	case c.ArrivalsPerStep <= 0:
		return bad("arrivals per step %v must be > 0", c.ArrivalsPerStep)
	case c.MaxRunning < 1 || c.StepTokens < 1 || c.PrefillChunk < 1:
		return bad("max running %d, step tokens %d and prefill chunk %d must be >= 1", c.MaxRunning, c.StepTokens, c.PrefillChunk)
	case c.StepInterval <= 0:
		return bad("step interval %v must be > 0", c.StepInterval)
	case c.MinPromptTokens < 1 || c.MaxPromptTokens < c.MinPromptTokens:
		return bad("prompt tokens %d..%d", c.MinPromptTokens, c.MaxPromptTokens)
	case c.MinOutputTokens < 1 || c.MaxOutputTokens < c.MinOutputTokens:
		return bad("output tokens %d..%d", c.MinOutputTokens, c.MaxOutputTokens)
	case c.SharedPrefixes < 0 || c.SharedPrefixTokens < 0:
		return bad("shared prefixes %d of %d tokens", c.SharedPrefixes, c.SharedPrefixTokens)
	case !ratio(c.SharedRatio) || !ratio(c.QueuedAbortRatio) || !ratio(c.MidAbortRatio) ||
		!ratio(c.PreemptRatio) || !ratio(c.ResumeHitRatio):
		return bad("ratios must be in [0, 1]")
	case c.QueuedAbortRatio+c.MidAbortRatio > 1:
		return bad("queued + mid abort ratios %v exceed 1", c.QueuedAbortRatio+c.MidAbortRatio)
	case c.DropBatches < 0 || c.DropBatches >= 1:
		return bad("drop batches %v: want [0, 1)", c.DropBatches)
	case c.RequestTimeout <= 0 || c.StallTimeout <= 0:
		return bad("request timeout %v and stall timeout %v must be > 0", c.RequestTimeout, c.StallTimeout)
	}
	if fi, err := os.Stat(c.ShmDir); err != nil || !fi.IsDir() {
		return bad("shm dir %q is not a directory", c.ShmDir)
	}
	// Every request must fit the blocks the scheduler may hand out, or it
	// would wait for ever.
	usable := c.NumGPUBlocks - 1 - c.VerifyBlocks
	for i, g := range c.Groups {
		switch g.Kind {
		case messages.KindFull, messages.KindEagle:
		case messages.KindSlidingWindow:
			if g.SlidingWindow < 1 {
				return bad("group %d: sliding window %d < 1", i, g.SlidingWindow)
			}
		default:
			return bad("group %d: kind %q: want full, sliding_window or eagle", i, g.Kind)
		}
		if g.TokensPerBlock < 1 || (g.TokensPerBlock*c.BlocksPerChunk)%c.TokensPerHash != 0 {
			return bad("group %d: tokens per chunk %d*%d is not a multiple of tokens_per_hash %d",
				i, g.TokensPerBlock, c.BlocksPerChunk, c.TokensPerHash)
		}
		if need := ceilDiv(c.MaxPromptTokens+c.MaxOutputTokens, g.TokensPerBlock); need > usable {
			return bad("group %d: the longest request needs %d blocks, only %d are usable", i, need, usable)
		}
	}
	return nil
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }
