package cluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/ingest"
)

// Errors of Owners.
var (
	// ErrFenced: a write of this node's ownership record failed its
	// compare-and-set: another node holds the engine now (or the record
	// lapsed and was re-created). The node must stop serving the engine.
	ErrFenced = errors.New("cluster: ownership fenced")
	// ErrNotMine: the engine is not held by this node.
	ErrNotMine = errors.New("cluster: engine not owned by this node")
	// ErrBadEngine: not an engine id ([A-Za-z0-9_-]{1,64}, not starting
	// with _), so never a key of the bucket.
	ErrBadEngine = errors.New("cluster: bad engine id")
)

// Owners is a node's view of the ownership bucket: it reads records,
// decides with ownership.Decide, claims with compare-and-set and keeps its
// own claims alive. Safe for concurrent use.
type Owners struct {
	cfg     Config
	kv      jetstream.KeyValue
	lead    nats.JetStreamContext // the stream leader's reads (leaderRead)
	me      ownership.Identity
	metrics *Metrics

	mu   sync.Mutex
	mine map[string]held // engines this process claimed and has not lost
	// lost are the engines whose held claims were fenced and not claimed
	// again since, for the next KeepAliveAll to report: a fence found by
	// Resolve's confirmation is reported as one found by a keep-alive.
	lost map[string]struct{}
	// took is how long each engine's last keep-alive took, failing short
	// of a verdict counted as forever: the next pass renews the quickest
	// first (KeepAliveAll).
	took map[string]time.Duration
}

// held is one engine this node claimed: the revision its last write got
// (the fencing token) and when it sent that write; unacked is when it sent
// the first write since, while no reply has said where that write went.
type held struct {
	rev     uint64
	renewed time.Time
	unacked time.Time
}

// sentBy is when this process's own write found at rev was sent, at the
// latest: its last known write's send time at that revision; past it, a
// write whose reply is not back yet (or was lost), sent no earlier than the
// first write not yet acknowledged, so a lease counted from it ends before
// the servers'. False when no write of this claim can be at rev (nothing
// sent since the last reply, or a revision below it).
func (h held) sentBy(rev uint64) (time.Time, bool) {
	switch {
	case rev == h.rev && h.rev != 0:
		return h.renewed, true
	case rev > h.rev && !h.unacked.IsZero():
		return h.unacked, true
	}
	return time.Time{}, false
}

// OpenOwners creates the ownership bucket, or binds to it if another node
// made it with the same settings; different settings (lease, replicas) are
// an error, since one node's lease cannot be another's.
func OpenOwners(ctx context.Context, js jetstream.JetStream, cfg Config, metrics *Metrics) (*Owners, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Node == "" || cfg.Boot == "" {
		return nil, fmt.Errorf("%w: node %q boot %q", ErrConfig, cfg.Node, cfg.Boot)
	}
	want := jetstream.KeyValueConfig{
		Bucket:      cfg.Bucket,
		Description: "kvactors engine ownership: engine id -> {node, boot}",
		History:     1,
		// The lease: a record not rewritten within it is removed by the
		// servers (stream max age), and the marker they leave tells
		// watchers it lapsed.
		TTL:            cfg.Lease,
		LimitMarkerTTL: cfg.Lease,
		Storage:        jetstream.FileStorage,
		Replicas:       cfg.Replicas,
	}
	kv, err := js.CreateKeyValue(ctx, want)
	if errors.Is(err, jetstream.ErrBucketExists) {
		// Refused as existing: it exists with other settings than want.
		diff, readErr := bucketDiffers(ctx, js, want)
		switch {
		case readErr != nil:
			diff = fmt.Sprintf("other settings than this node asks for, and its status could not be read to say which (%v)", readErr)
		case diff == "":
			diff = "other settings than this node asks for (made by another kvactors version, or by hand?)"
		}
		return nil, &bucketError{msg: fmt.Sprintf("%v: ownership bucket %s exists with %s: every node of a cluster "+
			"takes the bucket's (docs/CLUSTER.md)", ErrConfig, cfg.Bucket, diff), err: err, read: readErr}
	}
	if err != nil {
		return nil, fmt.Errorf("open ownership bucket %s (lease %v, replicas %d): %w", cfg.Bucket, cfg.Lease, cfg.Replicas, err)
	}
	lead, err := leaderReads(js)
	if err != nil {
		return nil, fmt.Errorf("open ownership bucket %s: %w", cfg.Bucket, err)
	}
	return &Owners{cfg: cfg, kv: kv, lead: lead, me: ownership.Identity{Node: cfg.Node, Boot: cfg.Boot}, metrics: metrics.orNew(), mine: map[string]held{}, lost: map[string]struct{}{}}, nil
}

// bucketError is OpenOwners' refusal of a bucket that exists with other
// settings: ErrConfig, the server's refusal and the error of a status read
// that failed, if one did (errors.Is finds each), its text the settings
// that differ only: the server's adds two lines saying "already in use"
// again.
type bucketError struct {
	msg  string
	err  error
	read error // reading the bucket's status; nil if it was read
}

func (e *bucketError) Error() string { return e.msg }
func (e *bucketError) Unwrap() []error {
	if e.read != nil {
		return []error{ErrConfig, e.err, e.read}
	}
	return []error{ErrConfig, e.err}
}

// bucketDiffers names the settings in which the existing bucket differs
// from want, once CreateKeyValue refused want as a bucket that exists with
// other settings: "" if none it compares does (OpenOwners then says "other
// settings"), or the error of reading its status. Lease and replicas are
// this node's flags; any other difference is a bucket made by another
// kvactors version, or by hand.
func bucketDiffers(ctx context.Context, js jetstream.JetStream, want jetstream.KeyValueConfig) (string, error) {
	st, err := bucketStatus(ctx, js, want.Bucket)
	if err != nil {
		return "", err
	}
	have := st.Config()
	var diffs []string
	if have.TTL != want.TTL {
		diffs = append(diffs, fmt.Sprintf("lease %v, not this node's %v (--lease)", have.TTL, want.TTL))
	}
	if have.Replicas != want.Replicas {
		diffs = append(diffs, fmt.Sprintf("replicas %d, not this node's %d (--cluster-replicas)", have.Replicas, want.Replicas))
	}
	if len(diffs) == 0 && (have.History != want.History || have.Storage != want.Storage ||
		have.LimitMarkerTTL != want.LimitMarkerTTL) {
		diffs = append(diffs, fmt.Sprintf("history %d, storage %v, limit-marker TTL %v, not %d, %v, %v "+
			"(made by another kvactors version, or by hand?)", have.History, have.Storage, have.LimitMarkerTTL,
			want.History, want.Storage, want.LimitMarkerTTL))
	}
	return strings.Join(diffs, " and "), nil
}

// Get reads engine's ownership; nil if nobody holds it.
func (o *Owners) Get(ctx context.Context, engine string) (*ownership.Entry, error) {
	return o.read(ctx, engine, o.cfg.Lease)
}

// read is Get with no-responders retried for up to within: no replica
// serves direct gets right now (the stream is new, or its leader is being
// elected). That passes; the read is retried rather than failing a
// register over it.
func (o *Owners) read(ctx context.Context, engine string, within time.Duration) (*ownership.Entry, error) {
	if !ingest.ValidEngineID(engine) {
		return nil, fmt.Errorf("%w: %q", ErrBadEngine, engine)
	}
	e, err := o.kv.Get(ctx, engine)
	for wait := time.Now().Add(within); errors.Is(err, nats.ErrNoResponders) && time.Now().Before(wait); {
		if !pause(ctx, 20*time.Millisecond) {
			break
		}
		e, err = o.kv.Get(ctx, engine)
	}
	return decodeEntry(engine, e, err)
}

// decodeEntry turns a bucket read into an entry: nil for a missing,
// deleted or expired key.
func decodeEntry(engine string, e jetstream.KeyValueEntry, err error) (*ownership.Entry, error) {
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound), errors.Is(err, jetstream.ErrKeyDeleted):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("read owner of engine %s: %w", engine, err)
	}
	r, err := ownership.DecodeRecord(e.Value())
	if err != nil {
		return nil, fmt.Errorf("owner of engine %s: %w", engine, err)
	}
	return &ownership.Entry{Record: r, Revision: e.Revision()}, nil
}

// Request is what the caller knows of one engine message beyond the
// bucket: see ownership.Input.
type Request struct {
	Register  bool
	SpecNode  string
	Local     bool
	NamedLive bool
	// StandbyForLive: see ownership.Input.
	StandbyForLive bool
}

// Resolve reads engine's ownership, decides, and performs a claim if that
// is the decision. A claim lost to another node's compare-and-set is
// decided again on the winner's record. Reads may be served by any replica
// (the bucket allows direct gets) and lag the write that beat this node, so
// the record is read until it shows a write past the one the claim was made
// on (readPast).
func (o *Owners) Resolve(ctx context.Context, engine string, req Request) (ownership.Decision, error) {
	e, err := o.Get(ctx, engine)
	if err != nil {
		return ownership.Decision{}, err
	}
	for attempt := 0; ; attempt++ {
		in, own := o.input(engine, e, req)
		d := ownership.Decide(in)
		if own {
			// Decided on this process's own write, the read being older:
			// a replica lagging it, or, were the bucket to lose writes and
			// issue revisions again, another node's newer claim behind a
			// lower revision. The keep-alive's compare-and-set on that write
			// tells them apart before anything is answered on it: it renews
			// the claim (one write, on stale reads only) or fences it, and
			// then the decision is made again on a fresh read.
			_, err := o.KeepAlive(ctx, engine)
			if err == nil {
				o.metrics.Decisions.WithLabelValues(d.Action.String()).Inc()
				return d, nil
			}
			if !(errors.Is(err, ErrFenced) || errors.Is(err, ErrNotMine)) || attempt == maxClaimAttempts {
				return ownership.Decision{}, err
			}
			if e, err = o.Get(ctx, engine); err != nil {
				return ownership.Decision{}, err
			}
			continue
		}
		o.metrics.Decisions.WithLabelValues(d.Action.String()).Inc()
		if d.Action != ownership.Claim {
			if d.Action == ownership.Ignore {
				o.forget(engine, e)
			}
			return d, nil
		}
		err = o.claim(ctx, engine, d.Revision, false)
		if err == nil {
			return ownership.Decision{Action: ownership.Serve, Owner: o.me.Node, Reason: d.Reason}, nil
		}
		if !errors.Is(err, ErrFenced) || attempt == maxClaimAttempts {
			return ownership.Decision{}, err
		}
		if e, err = o.readPast(ctx, engine, d.Revision); err != nil {
			return ownership.Decision{}, err
		}
	}
}

// maxClaimAttempts bounds Resolve's claim retries (each lost claim means
// another node wrote, which settles ownership, so a second loss is rare)
// and claim's retries of a write that was refused without a verdict.
const maxClaimAttempts = 5

// readPast reads engine's record until it shows a write after revision rev
// (0: none): a newer record, or none left (deleted or expired), within a
// lease. A failed read (a leader election in progress) is tried again, and
// so is a record older than rev: a replica that lags, such as a server
// whose routes just came back, still showing the previous owner's record
// (taken for the write after rev, it would fence a claim whose own write
// had landed). None left is taken only from the stream leader's read
// (leaderRead): a replica that has not seen the key's first write shows
// none too.
func (o *Owners) readPast(ctx context.Context, engine string, rev uint64) (*ownership.Entry, error) {
	return o.readUntil(ctx, engine, rev, false)
}

// errOnlyBelow is readUntil's answer when its time ran out after a read
// showed the key at or below where it waits (below rev, or at it when a
// record at rev does not end the wait): a read, not only failed ones.
var errOnlyBelow = errors.New("reads show the key only below the revision")

// readUntil is readPast, a record at rev itself also ending it when at is
// set. Its time run out, the error is errOnlyBelow if some read showed the
// key short of that (a record, or the stream leader's delete marker), and
// otherwise the last read's failure: no read answered (a leader election,
// no responders) says nothing of the key.
func (o *Owners) readUntil(ctx context.Context, engine string, rev uint64, at bool) (*ownership.Entry, error) {
	ctx, cancel := context.WithTimeout(ctx, o.cfg.Lease)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	ends := func(e *ownership.Entry) bool { return e != nil && (e.Revision > rev || (at && e.Revision == rev)) }
	below := false
	for {
		e, err := o.Get(ctx, engine)
		if err == nil && e != nil && e.Revision > rev {
			return e, nil
		}
		if err == nil && ((e != nil && ends(e)) || (e == nil && rev != 0)) {
			// A record at rev, or none, from a direct get, which any
			// replica answers: only the stream leader's read settles
			// those. A replica that lags a loss of the bucket's writes
			// still shows this node's record at a revision since issued
			// again to another node (taken for its own, the claim would be
			// written over that node's), and one that has not seen the
			// key's first write shows none.
			var last uint64
			if e, last, err = o.leaderRead(ctx, engine); err == nil && (ends(e) || (e == nil && (last == 0 || last > rev))) {
				return e, nil
			}
		}
		below = below || err == nil // a read answered, short of what ends the wait
		select {
		case <-ctx.Done():
			switch {
			case below:
				return nil, fmt.Errorf("read owner of engine %s past revision %d: %w", engine, rev, errOnlyBelow)
			case err != nil:
				return nil, fmt.Errorf("read owner of engine %s past revision %d: %w", engine, rev, err)
			}
			return nil, fmt.Errorf("read owner of engine %s past revision %d: %w", engine, rev, ctx.Err())
		case <-tick.C:
		}
	}
}

// Decide answers from the last read entry without I/O: for messages other
// than register, where the caller keeps the entry from a watch or from
// Resolve.
func (o *Owners) Decide(engine string, e *ownership.Entry, req Request) ownership.Decision {
	in, _ := o.input(engine, e, req)
	d := ownership.Decide(in)
	o.metrics.Decisions.WithLabelValues(d.Action.String()).Inc()
	return d
}

// input is what Decide decides engine's message on: e, or, when e is older
// than this process's own live write (no record, or a revision before it),
// that write, with own true. Such a read is no proof against the write;
// Resolve confirms the write before answering on it.
func (o *Owners) input(engine string, e *ownership.Entry, req Request) (in ownership.Input, own bool) {
	o.mu.Lock()
	h, held := o.mine[engine]
	o.mu.Unlock()
	now := time.Now()
	if held && (e == nil || e.Revision < h.rev) && now.Sub(h.renewed) < o.cfg.ServeFor() {
		e, own = o.heldEntry(h), true
	}
	var renewed time.Time
	if e != nil && e.Identity == o.me {
		// Nobody else writes this identity: the record is this process's
		// write, its reply back or not (a register read during a keep-alive
		// sees the keep-alive's write before its reply; taken for lapsed,
		// a register naming another node went unanswered by every node).
		var ok bool
		if renewed, ok = h.sentBy(e.Revision); ok && held && e.Revision > h.rev && !e.Closed {
			// A write whose reply is lost: the claim's renewal from now on
			// (landed), so Serving and the fencing token agree with what
			// is decided on it. Not a closed marker (this process's Leave,
			// no owner to every other node), as in claim.
			o.landed(engine, e.Revision)
		}
	}
	return ownership.Input{
		Entry: e, Me: o.me, StandbyFor: o.cfg.StandbyFor,
		Register: req.Register, SpecNode: req.SpecNode, Local: req.Local, NamedLive: req.NamedLive, StandbyForLive: req.StandbyForLive,
		Renewed: renewed, Lease: o.cfg.Lease, Skew: o.cfg.ClockSkew, Now: now,
	}, own
}

// heldEntry is the record this process wrote for a claim it holds.
func (o *Owners) heldEntry(h held) *ownership.Entry {
	return &ownership.Entry{
		Record:   ownership.Record{Identity: o.me, LeaseMS: o.cfg.Lease.Milliseconds(), Renewed: h.renewed.UnixMilli()},
		Revision: h.rev,
	}
}

// forget drops a claim the bucket no longer shows as this process's: one
// it shows under another identity at a revision past this process's own
// write. A read no newer than that write (a replica lagging it: reads may
// be direct gets) or one that shows no record is no proof, and dropping a
// live claim on it would stop the owner serving and renewing the engine
// while the bucket still names it; the keep-alive's compare-and-set
// settles those (docs/CLUSTER.md "Nothing is decided on a read alone").
func (o *Owners) forget(engine string, e *ownership.Entry) {
	if e == nil || e.Identity == o.me {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if h, ok := o.mine[engine]; ok && e.Revision > h.rev {
		delete(o.mine, engine)
	}
}

// KeepAlive rewrites engine's record on the revision this node last wrote:
// the lease starts again; ErrFenced if anyone else wrote since (the engine
// is lost: stop serving it), ErrNotMine if this node holds no claim.
func (o *Owners) KeepAlive(ctx context.Context, engine string) (uint64, error) {
	return o.keepAlive(ctx, engine, o.cfg.Lease/8)
}

// keepAlive is KeepAlive with its check's reads without responders retried
// for up to within.
func (o *Owners) keepAlive(ctx context.Context, engine string, within time.Duration) (uint64, error) {
	o.mu.Lock()
	h, ok := o.mine[engine]
	o.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("%w: %s", ErrNotMine, engine)
	}
	// Another node's record at the very revision this node wrote means the
	// bucket lost writes (its servers' unsynced tail, after a power loss)
	// and issued the revision again: a compare-and-set on it would succeed
	// and overwrite that node's claim. No lagging replica shows it (the
	// revision was this node's write), so it is proof; a write lost the
	// same way between this read and the compare-and-set is not caught
	// (docs/CLUSTER.md "Durability"). Reads without responders are retried
	// for lease/8 (within), not Get's lease: the keep-alive must renew well
	// inside the lease; past that the renewal goes ahead unchecked.
	if e, err := o.read(ctx, engine, within); err == nil && e != nil && e.Revision == h.rev && e.Identity != o.me {
		if !o.fence(engine) {
			return 0, fmt.Errorf("%w: %s (released during a keep-alive)", ErrNotMine, engine)
		}
		o.metrics.Fenced.Inc()
		return 0, fmt.Errorf("%w: engine %s: revision %d now names %s (the bucket lost writes and issued it again)",
			ErrFenced, engine, h.rev, e.Identity)
	}
	if err := o.claim(ctx, engine, h.rev, true); err != nil {
		return 0, err
	}
	return o.Revision(engine), nil
}

// KeepAliveAll renews every claim; it returns the engines lost (fenced,
// here or by a Resolve since the last call, and not claimed again) and the
// first other error (a NATS outage: claims stay and are retried next time,
// while the lease, measured locally, runs out). One engine's wait must not
// use up the pass's time for the others' renewals: the checks' reads
// without responders share one lease/8 across the pass, and the engines
// are renewed in the order of how long their last keep-alive took, one
// left unsettled (a refusal no read explains yet waits for the pass's
// whole deadline) last.
func (o *Owners) KeepAliveAll(ctx context.Context) (lost []string, err error) {
	reads := time.Now().Add(o.cfg.Lease / 8)
	engines := o.Mine()
	o.mu.Lock()
	slices.SortStableFunc(engines, func(a, b string) int { return cmp.Compare(o.took[a], o.took[b]) })
	o.mu.Unlock()
	took := make(map[string]time.Duration, len(engines))
	for _, engine := range engines {
		start, late := time.Now(), ctx.Err() != nil // late: the pass's time was up before its turn
		_, e := o.keepAlive(ctx, engine, max(time.Until(reads), 0))
		took[engine] = time.Since(start)
		if e != nil && !errors.Is(e, ErrFenced) {
			if !late {
				took[engine] = math.MaxInt64
			}
			if err == nil {
				err = e
			}
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.took = took
	for engine := range o.lost {
		lost = append(lost, engine)
	}
	clear(o.lost)
	slices.Sort(lost)
	return lost, err
}

// Release gives engine up (unregister, shutdown): the record is deleted
// only if this node's last write is still the latest.
func (o *Owners) Release(ctx context.Context, engine string) error {
	h, err := o.giveUp(engine)
	if err != nil {
		return err
	}
	if err := o.kv.Delete(ctx, engine, jetstream.LastRevision(h.rev)); err != nil {
		return fmt.Errorf("release engine %s (revision %d): %w", engine, h.rev, err)
	}
	return nil
}

// giveUp takes engine out of this node's claims (it serves it no more) and
// returns its claim; ErrNotMine if it held none.
func (o *Owners) giveUp(engine string) (held, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	h, ok := o.mine[engine]
	if !ok {
		return held{}, fmt.Errorf("%w: %s", ErrNotMine, engine)
	}
	delete(o.mine, engine)
	return h, nil
}

// Leave gives engine up on a graceful shutdown, its engine retired (no copy
// of it runs): the record is replaced, by compare-and-set on this node's
// last write, with one marked closed (ownership.Record.Closed). Every other
// node takes the marker for no owner, as it would a deleted record; this
// node's next boot, started within a lease, finds it (PastBoots) and tells
// the engine of the restart at once, as after a crash. A deleted record left
// the next boot blind to the engine, which then took a lease of silence to
// declare its node lost and a lease more to register.
func (o *Owners) Leave(ctx context.Context, engine string) error {
	h, err := o.giveUp(engine)
	if err != nil {
		return err
	}
	r := ownership.Record{Identity: o.me, LeaseMS: o.cfg.Lease.Milliseconds(), Renewed: time.Now().UnixMilli(), Closed: true}
	_, err = o.kv.Update(ctx, engine, ownership.EncodeRecord(r), h.rev)
	if err != nil && (errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)) {
		// A keep-alive of this process, its reply lost or cancelled (the
		// node stops its keep-alives before it leaves), may have landed
		// after h.rev: the marker replaces that write of its own.
		if e, gerr := o.readPast(ctx, engine, h.rev); gerr == nil && e != nil && e.Identity == o.me && !e.Closed {
			_, err = o.kv.Update(ctx, engine, ownership.EncodeRecord(r), e.Revision)
		}
	}
	if err != nil {
		return fmt.Errorf("leave engine %s (revision %d): %w", engine, h.rev, err)
	}
	return nil
}

// Revision is the fencing token of this node's claim on engine (0: none).
func (o *Owners) Revision(engine string) uint64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.mine[engine].rev
}

// Mine lists the engines this process holds claims on.
func (o *Owners) Mine() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]string, 0, len(o.mine))
	for e := range o.mine {
		out = append(out, e)
	}
	return out
}

// Serving reports whether this node may serve engine now: it holds a claim
// whose last successful write was sent less than a lease less the clock
// skew ago (the fencing rule; see ownership.Decide).
func (o *Owners) Serving(engine string, now time.Time) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	h, ok := o.mine[engine]
	return ok && now.Sub(h.renewed) < o.cfg.ServeFor()
}

// PastBoots lists the engines whose record names this node with another
// boot: a previous process of this node id, dead (a node id runs one
// process at a time), whose engines are still waiting to learn it, a closed
// marker (Leave) included. Read
// once at start from the bucket's current records (a watch's initial
// values).
func (o *Owners) PastBoots(ctx context.Context) ([]string, error) {
	t, err := watchOwners(ctx, o.kv)
	if err != nil {
		return nil, err
	}
	defer t.Stop()
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for engine, e := range t.entries {
		if e.Node == o.me.Node && e.Boot != o.me.Boot {
			out = append(out, engine)
		}
	}
	slices.Sort(out)
	return out, nil
}
