//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sim"
)

// replyDropper is TestSimWithDroppedReplies' fault pattern, deterministic in the order
// messages reach the engine, in two phases. Throughout, every 5th stored
// message is lost, and so is the first resync of each epoch: only the
// node's repeat of it (lease/4 later) gets through. In the first phase the
// 20th batch of each of the first three epochs is lost, so that the node
// orders resyncs (and loses them). The second begins with the fourth
// epoch and lasts to the end: every 7th released message is lost. The
// phases keep the recoveries apart: a lost release starts a new epoch,
// which would also end a gap whose resync was lost, and a resync
// re-announces every request, which would also recover a lost release; the
// second phase's lost releases have nothing to recover them but the SDK
// noticing them.
type replyDropper struct {
	mu       sync.Mutex
	gaps     int  // batches lost so far
	phase2   bool // releases are lost
	released int
	stored   int
	// resyncs counts the resync messages seen per epoch; an epoch whose
	// count passes 1 had its lost resync repeated by the node.
	resyncs map[string]int

	droppedReleased, droppedStored, droppedResyncs int
}

// gaps is how many epochs lose a batch (gapSeq) in the first phase.
const gaps, gapSeq = 3, 20

func (d *replyDropper) dropBatch(seq uint64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.phase2:
	case d.gaps == gaps && seq == 1: // the last gap's epoch ended
		d.phase2 = true
	case d.gaps < gaps && seq == gapSeq:
		d.gaps++
		return true
	}
	return false
}

func (d *replyDropper) dropIncoming(m *nats.Msg) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch verb := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]; verb {
	case messages.VerbReleased:
		d.released++
		if d.phase2 && d.released%7 == 0 {
			d.droppedReleased++
			return true
		}
	case messages.VerbStored:
		d.stored++
		if d.stored%5 == 0 {
			d.droppedStored++
			return true
		}
	case messages.VerbResync:
		var rs messages.Resync
		if json.Unmarshal(m.Data, &rs) != nil {
			return false // the client logs a bad body
		}
		d.resyncs[rs.Epoch]++
		if d.resyncs[rs.Epoch] == 1 {
			d.droppedResyncs++
			return true
		}
	}
	return false
}

// repeated is how many epochs whose first resync was lost got another.
func (d *replyDropper) repeated() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, c := range d.resyncs {
		if c > 1 {
			n++
		}
	}
	return n
}

// TestSimWithDroppedReplies is chaos 4 (TestSimWithDroppedBatches) the
// other way round: a real node's released, stored and resync messages are
// lost on their way to the simulated engine (client.Config.DropIncoming,
// replyDropper's pattern), and a few of the engine's batches too, so that
// the node orders resyncs to lose. It proves the simulator's oracle still
// holds (every finished or preempted event released exactly once, every
// ready chunk stored or present and loading back byte for byte: a lost
// stored only makes the check look the chunk up); that the SDK noticed
// each lost release (an rseq gap or a heartbeat's count) and recovered it
// with a lost_release resync, and each lost resync with the node's repeat
// or its own lost-tail check; and that nothing was left awaiting a release.
// Without either recovery the run stalls.
func TestSimWithDroppedReplies(t *testing.T) {
	dir, nc := simNode(t)

	d := &replyDropper{resyncs: map[string]int{}}
	cfg := sim.DefaultConfig()
	cfg.ShmDir, cfg.Log = dir, quietLog()
	cfg.Requests = 300
	cfg.ArrivalsPerStep = 1
	cfg.StepInterval = time.Millisecond
	cfg.StallTimeout = 10 * time.Second // an unrecovered loss stalls the run: fail sooner
	cfg.SDK = func(c *client.Config) { c.DropBatch, c.DropIncoming = d.dropBatch, d.dropIncoming }
	if *long {
		cfg.Requests = 3000
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := sim.Run(ctx, nc, cfg)
	require.NoError(t, err)
	require.NoError(t, rep.Err(), "first failures: %v", rep.Failures)
	require.Zero(t, rep.Missing+rep.MissingReleases+rep.DuplicateReleases+rep.UnknownReleases+rep.VerifyFailed)
	require.Positive(t, rep.VerifyOK)
	require.Zero(t, rep.Awaiting, "requests still awaiting a release when the session closed")

	repeated := d.repeated()
	d.mu.Lock()
	batches, released, stored, resyncs := d.gaps, d.droppedReleased, d.droppedStored, d.droppedResyncs
	t.Logf("%d requests, %d batches (%d dropped); dropped %d of %d released, %d of %d stored, %d resyncs "+
		"(%d repeated by the node); resyncs %v; %d chunks ready, %d stored, %d deduplicated, %d verified; releases %v",
		rep.Requests, rep.Batches, batches, released, d.released, stored, d.stored, resyncs, repeated,
		rep.ResyncsBy, rep.ChunksReady, rep.ReadyStored, rep.Deduplicated, rep.VerifyOK, rep.Releases)
	d.mu.Unlock()
	require.Positive(t, batches)
	require.Positive(t, released)
	require.Positive(t, stored)
	require.Positive(t, resyncs)
	require.Equal(t, released+stored+resyncs, rep.DroppedIncoming, "the SDK counted every message the hook dropped")
	require.Equal(t, batches, rep.DroppedBatches)
	require.Positive(t, rep.ResyncsBy[client.ResyncLostRelease], "lost releases recovered by resyncs")
	// In the first phase only gaps end epochs: each epoch whose resync was
	// lost ended on the node's repeat or on the SDK's own lost-tail check.
	require.Equal(t, gaps, batches)
	require.GreaterOrEqual(t, rep.ResyncsBy[client.ResyncNode]+rep.ResyncsBy[client.ResyncLostTail], resyncs,
		"each lost resync recovered")
}
