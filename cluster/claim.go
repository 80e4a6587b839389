package cluster

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/cluster/ownership"
)

// claim writes this node's record with compare-and-set: create when rev is
// 0, else replace rev. Four kinds of failed compare-and-set are not a
// fence:
//   - "wrong last sequence" without a sequence (JetStream error 10164): the
//     stream leader refused because another write of the key was still in
//     process; it says nothing about who won, so the write is tried again;
//   - a mismatch after which the record names this very node and boot: the
//     newer revision is this process's own write whose reply was lost (a
//     timeout across a leader change, or at a heal the deposed leader's
//     refusal arriving before the new leader's acknowledgement); nobody
//     else can write this identity, so the claim carries on from that
//     revision, and a held claim counts it as renewed (see landed);
//   - a mismatch with no read showing the write past rev before the time
//     runs out (every read from a replica that lags): the write after rev
//     may be this node's own. Unless the refusal named a last sequence
//     below rev (the bucket lost writes, below), it is no verdict;
//   - a refusal naming a last sequence below rev while the stream
//     leader's read shows the record at rev: a stream leader deposed but not yet told answered
//     from its store, behind rev; the write is tried again; and one after
//     which no read answers at all (an election) is no verdict.
//
// Anything else is ErrFenced. None of the four is a verdict when the tries
// (maxClaimAttempts in all) run out: the write fails as a NATS error
// would, and a held claim stays, bounded by its local lease. A stream
// leader cut off from its peers refuses every write of a key whose last
// write it could not commit as in process, for as long as it leads, and
// commits that write once its routes are back: fencing on either would drop
// engines nobody else wrote.
//
// renew (a keep-alive) races Release: a claim released meanwhile is not
// brought back (its fresh record is deleted again) nor reported fenced; it
// is ErrNotMine.
func (o *Owners) claim(ctx context.Context, engine string, rev uint64, renew bool) error {
	var err error
	for attempt := 1; ; attempt++ {
		sent := time.Now() // before the write: the servers' lease starts later
		o.sending(engine, sent)
		val := ownership.EncodeRecord(ownership.Record{Identity: o.me, LeaseMS: o.cfg.Lease.Milliseconds(), Renewed: sent.UnixMilli()})
		var nrev uint64
		if rev == 0 {
			nrev, err = o.kv.Create(ctx, engine, val)
		} else {
			nrev, err = o.kv.Update(ctx, engine, val, rev)
		}
		if err == nil {
			o.mu.Lock()
			h, still := o.mine[engine]
			if still || !renew {
				// Only a newer revision: this process's other writer of
				// the claim (a keep-alive and a register's confirmation
				// race) may have recorded a later write of it already, and
				// an older reply recorded after it would set the fencing
				// token back and date the record at the newer revision
				// from a later send.
				if !still || nrev > h.rev {
					o.mine[engine] = held{rev: nrev, renewed: sent}
				}
				delete(o.lost, engine) // held again: nothing to report
			}
			o.mu.Unlock()
			if !still && renew {
				_ = o.kv.Delete(ctx, engine, jetstream.LastRevision(nrev)) // best effort: the lease ends it anyway
				return fmt.Errorf("%w: %s (released during a keep-alive)", ErrNotMine, engine)
			}
			return nil
		}
		if !errors.Is(err, jetstream.ErrKeyExists) && !errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			return fmt.Errorf("claim engine %s: %w", engine, err)
		}
		if inProcessConflict(err) {
			o.metrics.Unsettled.WithLabelValues("in_process").Inc()
			if attempt == maxClaimAttempts || !pause(ctx, time.Duration(attempt)*10*time.Millisecond) {
				return fmt.Errorf("claim engine %s (revision %d): another write of it still in process at the stream leader: %w", engine, rev, err)
			}
			continue
		}
		var e *ownership.Entry
		var gerr error
		if last, ok := lastSequence(err); ok && last < rev {
			// The refusal puts the key's last write below rev: the bucket
			// lost writes, or a stream leader deposed but not yet told
			// (cut off, or just back) answered first from its store behind
			// the write at rev. The stream leader's record at rev refutes it
			// (readUntil: that write is committed; a replica's may lag a
			// loss): the write is tried again, unless a held
			// claim's revision now names another node (issued again, as
			// keepAlive's check). Reads only below rev, maybe all from that
			// server, cannot tell the two apart: fenced, as lost writes. No
			// read answering at all (an election: no responders) shows
			// neither: no verdict.
			if e, gerr = o.readUntil(ctx, engine, rev, true); errors.Is(gerr, errOnlyBelow) {
				break
			} else if gerr != nil {
				o.metrics.Unsettled.WithLabelValues("unexplained").Inc()
				return fmt.Errorf("claim engine %s refused as below revision %d, and no read answered: %w", engine, rev, gerr)
			}
			if e != nil && e.Revision == rev && (e.Identity == o.me || !renew) {
				o.metrics.Unsettled.WithLabelValues("stale").Inc()
				if attempt == maxClaimAttempts || !pause(ctx, time.Duration(attempt)*10*time.Millisecond) {
					return fmt.Errorf("claim engine %s: refused as below revision %d, which a read shows: %w", engine, rev, err)
				}
				continue
			}
		} else if e, gerr = o.readPast(ctx, engine, rev); gerr != nil {
			// A single read may come from a replica that lags the write
			// which caused the mismatch: readPast reads until the record
			// moves past rev.
			o.metrics.Unsettled.WithLabelValues("unexplained").Inc()
			return fmt.Errorf("claim engine %s (revision %d) refused, and no read shows the write past it: %w", engine, rev, gerr)
		}
		if e == nil || e.Identity != o.me || e.Closed {
			break // a closed marker is this process's Leave, not a claim's write
		}
		rev = e.Revision // this process's own write, whose reply was lost
		o.metrics.Unsettled.WithLabelValues("landed").Inc()
		o.landed(engine, rev)
		if attempt == maxClaimAttempts {
			return fmt.Errorf("claim engine %s: its own write at revision %d not renewed after %d tries: %w", engine, rev, attempt, err)
		}
	}
	if !o.fence(engine) && renew {
		return fmt.Errorf("%w: %s (released during a keep-alive)", ErrNotMine, engine)
	}
	o.metrics.Fenced.Inc()
	return fmt.Errorf("%w: engine %s (revision %d): %w", ErrFenced, engine, rev, err)
}

// sending notes a write of a held claim sent at sent, a keep-alive's or a
// register's claim on it: the first since the claim's last known landing
// is the earliest any write landing next can have been sent. Both kinds
// count: a keep-alive may find the other's write landed.
func (o *Owners) sending(engine string, sent time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if h, ok := o.mine[engine]; ok && h.unacked.IsZero() {
		h.unacked = sent
		o.mine[engine] = h
	}
}

// landed records this node's own write of a held claim found at rev, its
// reply lost, as a renewal sent when the first write not yet known to have
// landed was: any of them may be the one at rev, none was sent earlier, so
// the local lease still ends before the servers' does. Writes that expected an
// older revision cannot land after it. Without it, a heal (the deposed
// leader refusing each write as in process while the new leader commits
// it) let the lease run out on writes that all landed.
func (o *Owners) landed(engine string, rev uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if h, ok := o.mine[engine]; ok && rev > h.rev {
		if sent, ok := h.sentBy(rev); ok {
			o.mine[engine] = held{rev: rev, renewed: sent}
		}
	}
}

// fence forgets engine's claim, lost to another writer, and notes it for
// KeepAliveAll; false if none was held (a keep-alive that raced Release).
func (o *Owners) fence(engine string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, held := o.mine[engine]
	delete(o.mine, engine)
	if held {
		o.lost[engine] = struct{}{}
	}
	return held
}

// inProcessConflict: JetStream refused an expected-sequence write because
// another write of the subject was in flight (10164), not because the
// sequence was wrong.
func inProcessConflict(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

// lastSequence is the key's last sequence a "wrong last sequence" refusal
// (10071) names: "wrong last sequence: N" in nats-server's words.
func lastSequence(err error) (uint64, bool) {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence {
		return 0, false
	}
	_, n, ok := strings.Cut(apiErr.Description, "wrong last sequence: ")
	if !ok {
		return 0, false
	}
	seq, perr := strconv.ParseUint(strings.TrimSpace(n), 10, 64)
	return seq, perr == nil
}

// pause waits d or until ctx ends; false if ctx ended.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
