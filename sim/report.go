package sim

import (
	"errors"
	"fmt"
	"maps"
	"time"
)

// Report is what one engine saw and what its final check found. Chunk
// counts are per (group, chunk), so one request with two groups counts
// twice.
type Report struct {
	Engine string `json:"engine"`

	// Requests is how many requests arrived; Finished ended normally,
	// AbortedQueued were aborted before any block, AbortedMidPrefill during
	// prefill.
	Requests          int `json:"requests"`
	Finished          int `json:"finished"`
	AbortedQueued     int `json:"aborted_queued"`
	AbortedMidPrefill int `json:"aborted_mid_prefill"`
	// Preemptions counts preempted events; PreemptedPressure of them were
	// forced by a full block pool, the rest were chosen by PreemptRatio.
	// Resumes counts resumed events, ResumeHits those with a prefix-cache hit.
	Preemptions       int `json:"preemptions"`
	PreemptedPressure int `json:"preempted_pressure"`
	Resumes           int `json:"resumes"`
	ResumeHits        int `json:"resume_hits"`

	// Steps, Batches and Events count scheduler steps, published batches
	// and the events in them. TokensComputed counts prefill and decode
	// tokens, recomputation included.
	Steps          int   `json:"steps"`
	Batches        int   `json:"batches"`
	Events         int   `json:"events"`
	TokensComputed int64 `json:"tokens_computed"`
	// DroppedBatches were dropped on purpose (Config.DropBatches), Resyncs
	// counts new epochs the SDK started to recover (a node's resync, a lost
	// release, a new boot), NodeLosses the times it declared its node lost.
	DroppedBatches int `json:"dropped_batches"`
	Resyncs        int `json:"resyncs"`
	NodeLosses     int `json:"node_losses"`
	// ResyncsBy splits Resyncs by reason (client.Stats.Resyncs);
	// DroppedIncoming counts node messages dropped on purpose
	// (client.Config.DropIncoming); Awaiting is the requests still waiting
	// for a release when the session closed (client.Stats.Awaiting).
	ResyncsBy       map[string]int `json:"resyncs_by,omitempty"`
	DroppedIncoming int            `json:"dropped_incoming,omitempty"`
	Awaiting        int            `json:"awaiting,omitempty"`
	// RefusedEvents are events the SDK refused before sending (a request
	// id, count, group or hash the protocol does not allow): a scheduler
	// bug, since the node would never have taken them.
	RefusedEvents int `json:"refused_events"`

	// StoredJobs counts `stored` messages, ChunksStored the chunks in them
	// and BytesStored their bytes.
	StoredJobs   int   `json:"stored_jobs"`
	ChunksStored int   `json:"chunks_stored"`
	BytesStored  int64 `json:"bytes_stored"`
	// ChunksReady counts chunks that were ready when their request finished
	// (not aborted; full chunks of computed tokens with known hashes and
	// blocks, last block not null). Each is ReadyStored (this request's
	// store), Deduplicated (present: stored by another request or engine),
	// ReadyEvicted (absent, but its key was evicted), ReadySkipped (absent,
	// but the chunk had null blocks before a resume, so kvactors could pass
	// it over for good) or Missing (a failure).
	ChunksReady  int `json:"chunks_ready"`
	ReadyStored  int `json:"ready_stored"`
	Deduplicated int `json:"deduplicated"`
	ReadyEvicted int `json:"ready_evicted"`
	ReadySkipped int `json:"ready_skipped"`
	// ReadyNodeLost are ready chunks, absent, of requests whose release
	// said node_lost (the SDK gave up on a lost node).
	ReadyNodeLost int `json:"ready_node_lost"`
	Missing       int `json:"missing"`

	// Releases counts `released` by reason. DuplicateReleases are releases
	// beyond one per finished/preempted event, MissingReleases events that
	// were never released, UnknownReleases releases for requests this
	// engine never had.
	Releases          map[string]int `json:"releases"`
	DuplicateReleases int            `json:"duplicate_releases"`
	MissingReleases   int            `json:"missing_releases"`
	UnknownReleases   int            `json:"unknown_releases"`
	// UnexpectedReleases are releases the SDK took and the protocol does
	// not explain (client.Stats.UnexpectedRel: a request not waiting for
	// one, or one the mirror no longer has); the SDK hands none of them to
	// the engine, so the counts above never see them. UnowedResets are
	// the releases the protocol does explain although nothing was owed
	// (client.Stats.UnowedResets: the node's own reset of a running
	// request, after its NATS lapse or this engine's silence, or its drop
	// of the engine).
	UnexpectedReleases int `json:"unexpected_releases"`
	UnowedResets       int `json:"unowed_resets,omitempty"`
	// BadMessages counts stored or released bodies that were malformed or
	// disagreed with what the engine knows (a wrong key, wrong bytes, a
	// release's reason its event may not get).
	BadMessages int `json:"bad_messages"`

	// Evictions counts BlockRemoved chunks seen on any engine's kv_events.
	Evictions int `json:"evictions"`
	// Lookups, LookupHitTokens: the check's lookups and the tokens they hit.
	Lookups         int   `json:"lookups"`
	LookupHitTokens int64 `json:"lookup_hit_tokens"`
	// VerifyOK chunks were loaded back and matched the pattern byte for byte
	// (VerifiedBytes in all); VerifyFailed did not (or could not be loaded
	// for another reason than absence); VerifyEvicted were absent because
	// they had been evicted.
	VerifyOK      int   `json:"verify_ok"`
	VerifyFailed  int   `json:"verify_failed"`
	VerifyEvicted int   `json:"verify_evicted"`
	VerifiedBytes int64 `json:"verified_bytes"`

	// Interrupted says the run was cancelled (Ctrl-C) before it ended: the
	// check did not run, so the Verify counts are not a verdict.
	Interrupted bool `json:"interrupted,omitempty"`
	// CheckSkipped says the run ended on an error (Run's), or was
	// interrupted, before the final check finished: the Verify counts are
	// not a verdict either.
	CheckSkipped bool `json:"check_skipped,omitempty"`

	// Elapsed is the whole run; Serving excludes registration and the check.
	Elapsed time.Duration `json:"elapsed"`
	Serving time.Duration `json:"serving"`

	// Failures describes the first failed checks (at most maxFailures).
	Failures []string `json:"failures,omitempty"`
}

const maxFailures = 20

// ErrCheck wraps every failed check in Report.Err.
var ErrCheck = errors.New("sim: check failed")

// fail records one failed check.
func (r *Report) fail(format string, a ...any) {
	if len(r.Failures) < maxFailures {
		r.Failures = append(r.Failures, fmt.Sprintf(format, a...))
	}
}

// Err is nil when every check passed, else an error wrapping ErrCheck that
// says which.
func (r *Report) Err() error {
	var errs []error
	add := func(n int, what string) {
		if n > 0 {
			errs = append(errs, fmt.Errorf("%w: engine %s: %d %s", ErrCheck, r.Engine, n, what))
		}
	}
	add(r.VerifyFailed, "chunks failed byte verification")
	add(r.Missing, "ready chunks neither stored nor present")
	add(r.DuplicateReleases, "duplicate releases")
	add(r.MissingReleases, "missing releases")
	add(r.UnknownReleases, "releases for unknown requests")
	add(r.UnexpectedReleases, "releases the SDK could not match to an owed release (client.Stats.UnexpectedRel)")
	add(r.BadMessages, "bad stored or released messages")
	add(r.RefusedEvents, "events the SDK refused as the protocol does not allow them")
	if len(errs) == 0 && len(r.Failures) > 0 {
		errs = append(errs, fmt.Errorf("%w: engine %s: %s", ErrCheck, r.Engine, r.Failures[0]))
	}
	return errors.Join(errs...)
}

// Add sums o into r (for a demo with several engines). Engine, Elapsed and
// Serving take the larger value; Failures are concatenated up to the cap.
func (r *Report) Add(o Report) {
	r.Requests += o.Requests
	r.Finished += o.Finished
	r.AbortedQueued += o.AbortedQueued
	r.AbortedMidPrefill += o.AbortedMidPrefill
	r.Preemptions += o.Preemptions
	r.PreemptedPressure += o.PreemptedPressure
	r.Resumes += o.Resumes
	r.ResumeHits += o.ResumeHits
	r.Steps += o.Steps
	r.Batches += o.Batches
	r.Events += o.Events
	r.TokensComputed += o.TokensComputed
	r.DroppedBatches += o.DroppedBatches
	r.Resyncs += o.Resyncs
	r.DroppedIncoming += o.DroppedIncoming
	r.UnexpectedReleases += o.UnexpectedReleases
	r.UnowedResets += o.UnowedResets
	r.Awaiting += o.Awaiting
	if len(o.ResyncsBy) > 0 && r.ResyncsBy == nil {
		r.ResyncsBy = map[string]int{}
	}
	for k, v := range o.ResyncsBy {
		r.ResyncsBy[k] += v
	}
	r.NodeLosses += o.NodeLosses
	r.RefusedEvents += o.RefusedEvents
	r.StoredJobs += o.StoredJobs
	r.ChunksStored += o.ChunksStored
	r.BytesStored += o.BytesStored
	r.ChunksReady += o.ChunksReady
	r.ReadyStored += o.ReadyStored
	r.Deduplicated += o.Deduplicated
	r.ReadyEvicted += o.ReadyEvicted
	r.ReadySkipped += o.ReadySkipped
	r.ReadyNodeLost += o.ReadyNodeLost
	r.Missing += o.Missing
	if r.Releases == nil {
		r.Releases = map[string]int{}
	}
	for k, v := range o.Releases {
		r.Releases[k] += v
	}
	r.DuplicateReleases += o.DuplicateReleases
	r.MissingReleases += o.MissingReleases
	r.UnknownReleases += o.UnknownReleases
	r.BadMessages += o.BadMessages
	r.Evictions = max(r.Evictions, o.Evictions) // every engine sees every eviction
	r.Lookups += o.Lookups
	r.LookupHitTokens += o.LookupHitTokens
	r.VerifyOK += o.VerifyOK
	r.VerifyFailed += o.VerifyFailed
	r.VerifyEvicted += o.VerifyEvicted
	r.VerifiedBytes += o.VerifiedBytes
	r.Interrupted = r.Interrupted || o.Interrupted
	r.CheckSkipped = r.CheckSkipped || o.CheckSkipped
	r.Elapsed = max(r.Elapsed, o.Elapsed)
	r.Serving = max(r.Serving, o.Serving)
	for _, f := range o.Failures {
		if len(r.Failures) < maxFailures {
			r.Failures = append(r.Failures, f)
		}
	}
}

// clone copies the maps so a returned Report shares nothing with the engine.
func (r Report) clone() Report {
	r.Releases = maps.Clone(r.Releases)
	r.Failures = append([]string(nil), r.Failures...)
	return r
}

// Coverage is the check's reach: of the checked keys (every key reported
// stored or present at a request's finish, loaded back once per engine),
// matched were found and equal byte for byte. The rest were evicted before
// the check (or failed); a small pool evicts most, and then OK says little.
func (r *Report) Coverage() (matched, checked int) {
	return r.VerifyOK, r.VerifyOK + r.VerifyFailed + r.VerifyEvicted
}
