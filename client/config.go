package client

import (
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// Config says which engine this is and how to reach its node.
type Config struct {
	// Engine is the engine id: [A-Za-z0-9_-]{1,64}, not starting with "_".
	Engine string
	// Prefix is the subject prefix P (default "kvactors").
	Prefix string
	// Spec is the EngineSpec sent on every register.
	Spec messages.EngineSpec
	// RequestTimeout bounds each request/reply (default 5s).
	RequestTimeout time.Duration
	// DefaultLease is assumed when a register reply carries no lease_ms (a
	// v1 node). Default 10s, the protocol's default.
	DefaultLease time.Duration
	// MaxBatchBytes splits a resync's re-announcement, and a step's batch,
	// into batches of about this size, well under NATS' max_payload
	// (default 256 KiB; a batch may pass it by up to one event, whose
	// hashes or ids are split to fit).
	MaxBatchBytes int
	// OverflowBackoff is how long the client waits before answering a
	// resync whose reason is overflow (the node's intake was full and
	// dropped a batch): re-announcing every live request into a full
	// intake at once overflows it again. It doubles with each overflow
	// resync less than a lease after the last, up to lease/4, and each wait
	// is drawn from [½, 1] of it so engines spread out. Batches flushed
	// meanwhile are not sent (Stats.HeldBatches): the resync re-announces
	// them. Default 25ms; negative: answer at once.
	OverflowBackoff time.Duration
	// Log receives the client's warnings (default slog.Default()).
	Log *slog.Logger

	// OnReleased is called once per finished or preempted event whose GPU
	// blocks the engine may now reuse (see Release). Optional, but an
	// engine that never learns of releases can never reuse a block. A
	// block the engine drops mid-request (out of a sliding window) is
	// freed here too, not when dropped: the node may still be copying it
	// (docs/PROTOCOL.md, step 11).
	OnReleased func(Release)
	// OnStored is called once per P.E.stored message. Optional. A large
	// job's chunks may come in several messages with the same Job.
	OnStored func(messages.Stored)
	// OnRegisterRefused is called with each refused re-register after a
	// node loss or a node forgetting the engine (the client retries every
	// lease/4, since a refusal such as --max-engines may pass; Connect's own
	// register instead returns a refusal as its error). Optional; an
	// engine that wants to stop then must call Close from elsewhere.
	OnRegisterRefused func(error)

	// BeforePublish, if set, is called with each batch message just before
	// it is published (under the client's lock: keep it short), e.g. to add
	// a W3C traceparent header; events is the number of events in it.
	// (Lookup and Load take theirs from their ctx.)
	BeforePublish func(m *nats.Msg, seq uint64, events int)

	// DropBatch is fault injection for tests: when it returns true for a
	// batch's seq, that batch is counted in Stats.DroppedBatches and not
	// published, as if the transport had lost it. Nil in production.
	DropBatch func(seq uint64) bool

	// DropIncoming is fault injection for tests: when it returns true for
	// a message on P.E.released, P.E.stored or P.E.resync, the client
	// ignores it (counted in Stats.DroppedIncoming), as if the transport
	// had lost it on its way from the node. It is called on the NATS
	// client's goroutines, one per subscription, so it must be safe for
	// concurrent use, and must not keep or change m. Nil in production.
	DropIncoming func(m *nats.Msg) bool
}

// Release says that the GPU blocks a request gave up at one event may be
// reused: releases answer a request's owed events strictly in order, so
// each answers its oldest preempted or finished still owed one, and frees
// the blocks it held at that event (none for a finished while preempted:
// those go back with the preemption's release). Blocks it got later, after
// a resumed, may still be copied from (PROTOCOL.md step 11).
type Release struct {
	Request string
	// Reason is the node's (finished, aborted, preempted, engine_reset,
	// engine_gone) or messages.ReasonNodeLost when the node was lost; the
	// client also answers engine_gone itself for an event while the node
	// has forgotten the engine and holds nothing of the request (doc.go).
	// It may be a later owed event's: after a lost release, that event's
	// release of the same epoch answers the oldest owed one (PROTOCOL.md
	// step 11 lists the reasons an owed event's release may carry).
	Reason string
	// Epoch is the epoch the release answers (empty for one the client
	// made: node_lost, and its own engine_gone).
	Epoch string
}

var engineID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ErrConfig wraps every configuration error.
var ErrConfig = errors.New("client: bad config")

// ErrBadRequestID is Added's error for a request id the protocol does not
// allow: empty, over 256 bytes, or not valid UTF-8 (the node rejects it
// as bad_request_id).
var ErrBadRequestID = errors.New("bad request id: want 1..256 bytes of UTF-8")

// ErrBadHash is Hashes' error for a hash the node rejects as bad_hash:
// empty, or over 64 bytes (ingest.Limits.MaxHashBytes).
var ErrBadHash = errors.New("bad hash: want 1..64 bytes")

// ErrOutOfRange is an event method's error for a negative count or start,
// a group the spec does not have, a block id at or past its
// num_gpu_blocks, or hashes or block ids past what its max_model_len lets
// a request hold (the node rejects the event as out_of_range, bad_group,
// block_range or too_large, changing nothing).
var ErrOutOfRange = errors.New("out of range: counts and starts must be ≥ 0, groups and block ids within the spec")

// protocolLimits bound request ids at the protocol's 256 bytes and hashes
// at the node's 64; a node may set other bounds (MaxRequestIDBytes lower,
// MaxHashBytes either way), which the client cannot know.
var protocolLimits = ingest.DefaultLimits()

// validRequestID applies the node's rule (ingest.CheckRequestID).
func validRequestID(id string) bool { return ingest.CheckRequestID(id, protocolLimits) == nil }

func (c *Config) withDefaults() (Config, error) {
	out := *c
	if !engineID.MatchString(out.Engine) || out.Engine[0] == '_' {
		return out, fmt.Errorf("%w: engine id %q: want [A-Za-z0-9_-]{1,64}, not starting with _", ErrConfig, out.Engine)
	}
	if out.Prefix == "" {
		out.Prefix = "kvactors"
	}
	if out.RequestTimeout <= 0 {
		out.RequestTimeout = 5 * time.Second
	}
	if out.DefaultLease <= 0 {
		out.DefaultLease = 10 * time.Second
	}
	if out.OverflowBackoff == 0 {
		out.OverflowBackoff = 25 * time.Millisecond
	}
	if out.MaxBatchBytes <= 0 {
		out.MaxBatchBytes = 256 << 10
	}
	if out.Log == nil {
		out.Log = slog.Default()
	}
	if len(out.Spec.Groups) == 0 {
		return out, fmt.Errorf("%w: the spec has no groups", ErrConfig)
	}
	return out, nil
}

// InboxPrefix is the reply-inbox prefix engine's NATS connection must use,
// so that NATS permissions can confine its replies to `_INBOX.<engine>.>`.
func InboxPrefix(engine string) string { return messages.InboxRoot + engine }

// Options are the nats.Options an engine's connection needs: the
// per-engine inbox prefix, a name, and reconnecting forever (the client
// resyncs after a reconnect). Two of them the node-loss frees rely on
// (PROTOCOL.md step 2): no reconnect buffer, so nothing published while the
// link is down reaches the node after the client freed its requests (a
// publish then fails at once, and the client resyncs); and a ping interval
// that closes a dead link, dropping what it had not sent, well before
// the client can free (see CheckConn). Pass them to nats.Connect, or use
// Dial. The pings (2 s, 2 outstanding: a dead link closes within 6 s) suit
// a lease over 8 s, the default 10 s; for a node with a shorter --lease
// pass shorter ones after these (Dial's opts come last, so they win),
// else CheckConn's Warn at each register says the link closes too late.
func Options(engine string) []nats.Option {
	return []nats.Option{
		nats.CustomInboxPrefix(InboxPrefix(engine)),
		nats.Name("kvactors-engine-" + engine),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectBufSize(-1),
		nats.PingInterval(2 * time.Second),
		nats.MaxPingsOutstanding(2),
	}
}

// CheckConn says what is wrong, if anything, with the settings of engine's
// connection o for a node whose lease is lease: another reply-inbox prefix
// than InboxPrefix(engine) (under per-engine NATS permissions no reply
// would reach it: every request times out, and Connect retries forever); a
// reconnect buffer (batches published while the link was down would be
// replayed to the node after the client freed their requests); or a dead
// link not closed within 3/4 of the lease (PingInterval ×
// (MaxPingsOut+1)). The client logs it at Warn at each register.
func CheckConn(o nats.Options, engine string, lease time.Duration) []string {
	var bad []string
	if want := InboxPrefix(engine); o.InboxPrefix != want {
		got := o.InboxPrefix
		if got == "" {
			got = "the default _INBOX"
		}
		bad = append(bad, fmt.Sprintf("the reply-inbox prefix is %s, want %s (nats.CustomInboxPrefix): the node "+
			"answers this engine's requests only there (and under per-engine NATS permissions no other reply "+
			"would reach it)", got, want))
	}
	if o.ReconnectBufSize >= 0 {
		bad = append(bad, fmt.Sprintf("ReconnectBufSize is %d, want -1 (nats.ReconnectBufSize(-1)): a batch "+
			"published while the link is down would reach the node after its requests were freed", o.ReconnectBufSize))
	}
	if d := o.PingInterval * time.Duration(o.MaxPingsOut+1); o.PingInterval <= 0 || 4*d >= 3*lease {
		bad = append(bad, fmt.Sprintf("a dead link is closed only after PingInterval × (MaxPingsOut+1) = %v × %d, "+
			"want under 3/4 of the lease %v (nats.PingInterval, nats.MaxPingsOutstanding)", o.PingInterval,
			o.MaxPingsOut+1, lease))
	}
	return bad
}

// Dial connects to NATS at url with Options(engine) followed by opts.
func Dial(url, engine string, opts ...nats.Option) (*nats.Conn, error) {
	nc, err := nats.Connect(url, append(Options(engine), opts...)...)
	if err != nil {
		return nil, fmt.Errorf("client: connect to NATS at %s: %w", url, err)
	}
	return nc, nil
}
