package client

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// Duties of PROTOCOL.md's engine checklist that no other test would miss:
// each test below fails with the code it names taken out.

// sessionClient is a Client registered with node n1, boot b1, in epoch e1,
// with no connection (what these tests call sends nothing).
func sessionClient(t *testing.T) *Client {
	t.Helper()
	c := &Client{reqs: map[string]*mreq{}, groups: 1, st: Stats{Resyncs: map[string]int{}},
		cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxBatchBytes: 1 << 20,
			OverflowBackoff: 25 * time.Millisecond, RequestTimeout: 5 * time.Second},
		out: newDispatcher(nil, nil, nil), epoch: "e1", node: "n1", boot: "b1", lease: 8 * time.Second,
		kick: make(chan struct{}, 1)}
	t.Cleanup(c.out.close)
	return c
}

func msgOf(t *testing.T, body any) *nats.Msg {
	t.Helper()
	data, err := json.Marshal(body)
	require.NoError(t, err)
	return &nats.Msg{Data: data}
}

// reannounced is what a resync of c would re-announce, decoded.
func reannounced(t *testing.T, c *Client) []messages.Event {
	t.Helper()
	c.batch.Reset()
	c.reannounceLocked(func() {})
	dec, bad, err := ingest.DecodeBatch("e", c.batch.Body(nil, "x", 1), ingest.Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	return dec.Events
}

// heartbeatReply hands c's heartbeat code rep as the reply to a heartbeat
// of epoch and seq it has just sent (a probe numbered now), from n1.
func heartbeatReply(t *testing.T, nc *nats.Conn, c *Client, epoch string, seq uint64, rep messages.HeartbeatReply) {
	t.Helper()
	sub, err := nc.SubscribeSync(nc.NewInbox())
	require.NoError(t, err)
	if rep.Node == "" {
		rep.Node, rep.Boot = "n1", "b1"
	}
	rep.Epoch = epoch
	data, err := json.Marshal(rep)
	require.NoError(t, err)
	require.NoError(t, nc.Publish(sub.Subject, data))
	c.heartbeat(epoch, seq, c.probeLocked(), sub, 0)
}

// Step 18: a resync re-announces added with its max_offload_tokens; left
// out, the new epoch's node would store the request past its cap.
func TestAResyncReannouncesMaxOffloadTokens(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	require.NoError(t, c.AddedMax("r", 16, 4))
	require.NoError(t, c.Added("s", 16))
	got := map[string]int{}
	for _, ev := range reannounced(t, c) {
		if ev.Type == messages.EvAdded {
			got[ev.Request] = ev.MaxOffloadTokens
		}
	}
	require.Equal(t, map[string]int{"r": 4, "s": -1}, got)
}

// Step 10: a release whose rseq is at or below the highest seen this epoch
// is a duplicate: counted again it would answer a second owed event and
// hand the engine blocks the node may still copy.
func TestADuplicateReleaseFreesNothing(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	require.NoError(t, c.Added("r", 8))
	require.NoError(t, c.Blocks("r", 0, 0, []uint32{1}))
	c.Preempted("r")
	c.Resumed("r")
	require.NoError(t, c.Blocks("r", 0, 0, []uint32{2}))
	require.NoError(t, c.Finished("r", false, 8, 8))
	require.Equal(t, 2, c.reqs["r"].owed)
	rel := messages.Released{Request: "r", Epoch: "e1", RSeq: 1, Reason: messages.ReasonPreempted}
	c.onReleased(msgOf(t, rel))
	c.onReleased(msgOf(t, rel))
	require.Equal(t, 1, c.reqs["r"].owed, "the duplicate answered the finish too")
	require.Equal(t, 1, c.st.Releases)
	require.Equal(t, uint64(1), c.relGot, "a duplicate is not received twice")
}

// Steps 13 and 15: while the node is lost, its messages (the same boot's)
// do not move last_seen: the frees wait a lease from the last sign of life
// before the loss, or a node heard again every lease/4 would put them, and
// the register after them, off for as long as it heartbeats.
func TestANodeHeardWhileLostDoesNotPutOffTheFrees(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	seen := time.Now().Add(-time.Hour)
	c.lastSeen = seen
	c.loseLocked("test")
	free := c.freeAtLocked()
	c.seenLocked("n1", "b1")       // a hello or node heartbeat
	c.repliedLocked("n1", "b1", 7) // a reply
	require.Equal(t, seen, c.lastSeen)
	require.Equal(t, free, c.freeAtLocked())
}

// Step 17: a P.E.resync for an epoch already left orders nothing (the
// node repeats its order while the old epoch's messages arrive); and a
// repeated overflow order while the resync waits does not re-arm its
// wait, which could put the resync off for ever.
func TestResyncOrders(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	c.onResync(msgOf(t, messages.Resync{Node: "n1", Boot: "b1", Epoch: "e0", Reason: messages.ResyncGap}))
	require.Empty(t, c.resync, "an order for an old epoch")

	c.onResync(msgOf(t, messages.Resync{Node: "n1", Boot: "b1", Epoch: "e1", Reason: messages.ResyncOverflow}))
	require.Equal(t, ResyncNode, c.resync)
	hold := c.holdUntil
	require.False(t, hold.IsZero())
	for range 8 {
		c.onResync(msgOf(t, messages.Resync{Node: "n1", Boot: "b1", Epoch: "e1", Reason: messages.ResyncOverflow}))
	}
	require.Equal(t, hold, c.holdUntil, "a repeated order moved the wait")
	require.Equal(t, 1, c.overflows)
}

// Step 11: engine_gone in the current epoch means the node dropped the
// engine: register again (a heartbeat's "unknown engine" would say so only
// a period later, the engine's batches meanwhile sent to a node that
// rejects them).
func TestAnEngineGoneOfTheCurrentEpochRegistersAgain(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	require.NoError(t, c.Added("r", 8))
	c.onReleased(msgOf(t, messages.Released{Request: "r", Epoch: "e1", RSeq: 1, Reason: messages.ReasonEngineGone}))
	require.True(t, c.reregister)
}

// Step 18: a preempted request that owes nothing is re-announced without
// blocks, and the release its preempted gets at once is absorbed: neither
// handed to the engine nor counted as unexplained.
func TestTheReleaseOfAReannouncedFreedPreemptionIsAbsorbed(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	require.NoError(t, c.Added("r", 8))
	require.NoError(t, c.Blocks("r", 0, 0, []uint32{1}))
	c.Preempted("r")
	c.onReleased(msgOf(t, messages.Released{Request: "r", Epoch: "e1", RSeq: 1, Reason: messages.ReasonPreempted}))
	require.Equal(t, 1, c.st.Releases)
	c.resync = ResyncEngine
	c.resyncLocked()
	c.onReleased(msgOf(t, messages.Released{Request: "r", Epoch: c.epoch, RSeq: 1, Reason: messages.ReasonPreempted}))
	require.Equal(t, 1, c.st.Releases)
	require.Zero(t, c.st.UnexpectedRel)
	require.False(t, c.reqs["r"].silent)
}

// Step 15: once a lost node's frees are done, a finished or preempted is
// answered node_lost at once: no node can copy its blocks, and none may
// ever come back to release it.
func TestAnEventAfterTheLossFreesIsFreedAtOnce(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	for _, r := range []string{"f", "p"} {
		require.NoError(t, c.Added(r, 8))
		require.NoError(t, c.Blocks(r, 0, 0, []uint32{1}))
	}
	c.lastSeen = time.Now().Add(-time.Hour)
	c.loseLocked("test")
	c.freeLossLocked()
	require.NoError(t, c.Finished("f", false, 8, 8))
	c.Preempted("p")
	require.Equal(t, 2, c.st.NodeLostFrees)
	require.NotContains(t, c.reqs, "f")
	require.Zero(t, c.reqs["p"].owed)
}

// Step 12: a heartbeat reply counts releases against those received only
// when the remembered reply is at least half a period old, never for an
// epoch since left, and a resync forgets the remembered one: else a
// release still on its way, or the old epoch's count, reads as a lost
// release and starts a resync for nothing.
func TestHeartbeatRepliesJudgeOnlyTheirEpochHalfAPeriodOn(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	c := sessionClient(t)
	c.lease = 4 * time.Minute // a period of a minute: the replies below come well within half of it
	beat := func(epoch string, seq uint64, rep messages.HeartbeatReply) {
		t.Helper()
		heartbeatReply(t, nc, c, epoch, seq, rep)
	}

	beat("e0", 0, messages.HeartbeatReply{Released: 9}) // its heartbeat was sent before e1 began
	require.Zero(t, c.hbPrev, "an old epoch's count remembered")
	require.True(t, c.hbPrevAt.IsZero())

	beat("e1", 0, messages.HeartbeatReply{Released: 2}) // remembered: none was
	beat("e1", 0, messages.HeartbeatReply{Released: 2}) // too young to judge: the 2 may be on their way
	require.Empty(t, c.resync)

	c.hbPrevAt = time.Now().Add(-time.Hour)
	c.resync = ResyncEngine
	c.resyncLocked()
	beat(c.epoch, 0, messages.HeartbeatReply{})
	require.Empty(t, c.resync, "the old epoch's count judged the new one")
}

// Step 11: the node may hold a request once one of its events was
// published, not once it went into a batch: a batch dropped unsent (the
// node forgot the engine before the Flush, an overflow's wait, a publish
// the link refused) told the node nothing, so a Finished while the node
// has forgotten the engine is answered at once, not left waiting for an
// engine_gone that never comes until a register the node may refuse for
// long. One whose batch, or resync, went out waits for its engine_gone.
func TestOnlyAPublishedEventPutsARequestAtTheNode(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	down, err := nats.Connect(nc.ConnectedUrl())
	require.NoError(t, err)
	down.Close()
	for _, tc := range []struct {
		name  string
		nc    *nats.Conn
		drop  func(c *Client)
		freed bool
	}{
		{"discarded", nc, func(c *Client) { c.reregister = true }, true},
		{"held", nc, func(c *Client) { c.resync, c.holdUntil = ResyncNode, time.Now().Add(time.Hour) }, true},
		{"refused", down, func(*Client) {}, true},
		{"sent", nc, func(*Client) {}, false},
		{"re-announced", nc, func(c *Client) { c.resync = ResyncEngine }, false}, // the Flush resyncs
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := sessionClient(t)
			c.nc, c.subj = tc.nc, "kvactors.e1."
			require.NoError(t, c.Added("r", 8))
			tc.drop(c)
			require.NoError(t, c.Flush())
			c.reregister = true // an "unknown engine" heartbeat reply
			require.NoError(t, c.Finished("r", false, 8, 8))
			if tc.freed {
				require.Equal(t, 1, c.st.ForgottenFrees, "the Finished waits for an engine_gone")
				require.NotContains(t, c.reqs, "r")
			} else {
				require.Zero(t, c.st.ForgottenFrees, "freed while the node may copy")
				require.Equal(t, 1, c.reqs["r"].owed)
			}
		})
	}
}

// Step 3: the client lifts the pending limits of every subscription: a
// release dropped as a slow consumer's costs a resync.
func TestEverySubscriptionHasItsPendingLimitsLifted(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	c := sessionClient(t)
	c.nc, c.subj, c.cfg.Prefix = nc, "kvactors.e1.", "kvactors"
	require.NoError(t, c.subscribe())
	t.Cleanup(c.unsubscribe)
	require.Len(t, c.subs, 5)
	for _, s := range c.subs {
		msgs, bytes, err := s.PendingLimits()
		require.NoError(t, err)
		require.Equal(t, [2]int{-1, -1}, [2]int{msgs, bytes}, "the pending limits of %s", s.Subject)
	}
}

// Step 14: the session notices a node silent for a lease when the lease
// runs out, on a timer of its own, not at its next heartbeat tick (a
// period later; here, a lease of an hour, never within the test).
func TestTheNodeIsLostWhenItsLeaseRunsOut(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t) // no node: every request gets no responders
	c := sessionClient(t)
	c.nc, c.subj, c.stop = nc, "kvactors.e1.", make(chan struct{})
	c.lease = time.Hour
	c.lastSeen = time.Now().Add(50*time.Millisecond - c.lease)
	c.wg.Add(1)
	go c.loop()
	t.Cleanup(func() {
		close(c.stop)
		c.wg.Wait()
	})
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if c.Stats().NodeLosses == 0 {
			return errors.New("the node is not lost yet")
		}
		return nil
	})
}

// The checklist's clock rule: a lease is measured on the monotonic clock.
// Each time below was taken before the wall clock stepped (an NTP step, a
// resumed VM): forward, a node heard a moment ago is not lost; back, one
// silent for two leases is lost, and its requests freed at once.
func TestTheLeaseIsMeasuredOnTheMonotonicClock(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t) // no node: every request gets no responders
	for _, tc := range []struct {
		name      string
		ago, step time.Duration
		lost      bool
	}{
		{"forward", 0, 2 * time.Hour, false},
		{"back", 2 * 8 * time.Second, -2 * time.Hour, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := sessionClient(t) // a lease of 8 s
			c.nc, c.subj = nc, "kvactors.e1."
			require.NoError(t, c.Added("r", 8))
			require.NoError(t, c.Finished("r", false, 8, 8))
			// A reading taken ago earlier whose wall clock has since stepped
			// by step: against now's, its wall time is off by -step.
			then := testkit.WallStepped(time.Now().Add(-tc.ago), -tc.step)
			c.lastSeen = then
			c.sent.end(c.sent.begin(then), nil)
			c.tickOnce()
			st := c.Stats()
			require.Equal(t, tc.lost, st.NodeLosses == 1, "lost")
			require.Equal(t, tc.lost, st.NodeLostFrees == 1, "freed")
		})
	}
}

// Step 12: a heartbeat reply saying "unknown engine" asks for a register
// only from the registered boot: from another node (a cluster's, which
// does not own the engine) it is nothing, and from another boot of the
// node a restart (step 14), whose loss registers again in its own time.
func TestOnlyTheRegisteredBootsUnknownEngineRegistersAgain(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	for _, tc := range []struct {
		node, boot       string
		reregister, lost bool
	}{
		{"n1", "b1", true, false},
		{"n2", "x1", false, false},
		{"n1", "b2", false, true},
	} {
		c := sessionClient(t)
		heartbeatReply(t, nc, c, "e1", 0, messages.HeartbeatReply{Node: tc.node, Boot: tc.boot,
			Error: `unknown engine "e1"`})
		require.Equal(t, tc.reregister, c.reregister, "a re-register pending after %s/%s's reply", tc.node, tc.boot)
		require.Equal(t, tc.lost, c.lost, "the node lost after %s/%s's reply", tc.node, tc.boot)
	}
}

// A release that arrives once Close has begun (the unregister's
// engine_gone ones, or one in flight) frees nothing and calls for
// nothing: the engine is done with the session, and Close says no
// callback comes after it.
func TestAReleaseAfterCloseIsStale(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	require.NoError(t, c.Added("r", 8))
	require.NoError(t, c.Finished("r", false, 8, 8))
	c.closed = true // Close's first step
	for i, reason := range []string{messages.ReasonFinished, messages.ReasonEngineGone} {
		c.onReleased(msgOf(t, messages.Released{Request: "r", Epoch: "e1", RSeq: uint64(i + 1), Reason: reason}))
	}
	require.Equal(t, 2, c.st.StaleReleases)
	require.Zero(t, c.st.Releases)
	require.Equal(t, 1, c.reqs["r"].owed)
	require.False(t, c.reregister)
}

// Step 18: a resync re-announces the requests oldest first (in the order
// of their added), whatever their ids and later events.
func TestAResyncReannouncesOldestFirst(t *testing.T) {
	t.Parallel()
	c := sessionClient(t)
	var want []string
	for i := range 16 {
		id := fmt.Sprintf("r%02d", 16-i) // ids sort against arrival
		require.NoError(t, c.Added(id, 8))
		want = append(want, id)
	}
	require.NoError(t, c.Tokens(want[0], 4, 8)) // a later event of the oldest
	var got []string
	for _, ev := range reannounced(t, c) {
		if ev.Type == messages.EvAdded {
			got = append(got, ev.Request)
		}
	}
	require.Equal(t, want, got)
}

// Step 11: a request finished or preempted in a step not published yet
// (still in the batch, or held by an overflow's wait) when the node
// forgets the engine is one the node holds nothing of: its batch is
// discarded from then on, so it is answered at once (engine_gone), as a
// Finished coming after would be, not left waiting for a register the
// node may refuse for long. One already at the node waits for its own
// engine_gone.
func TestForgettingAnswersWhatNoPublishedBatchCarried(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	for _, tc := range []struct {
		name   string
		forget func(c *Client)
	}{
		{"unknown engine", func(c *Client) {
			heartbeatReply(t, nc, c, "e1", 0, messages.HeartbeatReply{Error: `unknown engine "e1"`})
		}},
		{"engine_gone", func(c *Client) {
			c.onReleased(msgOf(t, messages.Released{Request: "s", Epoch: "e1", RSeq: 1, Reason: messages.ReasonEngineGone}))
		}},
	} {
		for _, held := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s held=%v", tc.name, held), func(t *testing.T) {
				c := sessionClient(t)
				c.nc, c.subj = nc, "kvactors.e1."
				require.NoError(t, c.Added("s", 8)) // at the node
				require.NoError(t, c.Added("p", 8))
				require.NoError(t, c.Flush())
				require.NoError(t, c.Added("r", 8))
				require.NoError(t, c.Finished("r", false, 8, 8))
				require.NoError(t, c.Added("q", 8))
				c.Preempted("q")
				c.Preempted("p")
				if held {
					c.resync, c.holdUntil = ResyncNode, time.Now().Add(time.Hour)
					require.NoError(t, c.Flush())
				}
				tc.forget(c)
				require.True(t, c.reregister)
				require.NotContains(t, c.reqs, "r", "r waits for an engine_gone the node never sends")
				require.Zero(t, c.reqs["q"].owed, "q waits for an engine_gone the node never sends")
				require.Equal(t, 1, c.reqs["p"].owed, "p freed while the node may copy")
			})
		}
	}
}
