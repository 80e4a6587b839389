package node

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/ratelog"
)

// The connection's slow-consumer error reaches the handler of the
// subscription NATS dropped messages of: the intake's makes every engine
// resync (its lost batches name no engine); another subscription's does
// not touch the intake. The handlers are read under a lock: the error
// handler runs on NATS's goroutine, also while the node is still starting.
func TestASlowConsumerErrorReachesItsSubscriptionsHandler(t *testing.T) {
	t.Parallel()
	n, nc, _ := startInternal(t, nil)
	overflow := n.metrics.DroppedBatch(messages.ResyncOverflow)
	other, err := nc.SubscribeSync("elsewhere")
	require.NoError(t, err)
	onError := n.nc.Opts.AsyncErrorCB

	onError(n.nc, other, nats.ErrSlowConsumer)
	require.Zero(t, testutil.ToFloat64(overflow), "another subscription's drop is not the intake's")
	require.False(t, n.ingest.anyLost.Load())

	onError(n.nc, n.ingest.sub, nats.ErrSlowConsumer)
	require.Equal(t, 1.0, testutil.ToFloat64(overflow))
	n.ingest.lostMu.Lock()
	all := n.ingest.lostAll
	n.ingest.lostMu.Unlock()
	require.True(t, all || !n.ingest.anyLost.Load(), "every engine is to resync (or has been told already)")
}

// The NATS client's pending queue for the intake is bounded in messages
// as well as bytes: nats.go counts only a message's body and headers, so
// without it a flood of empty messages would queue almost for free.
func TestTheIntakeSubscriptionBoundsPendingMessagesToo(t *testing.T) {
	t.Parallel()
	n, _, _ := startInternal(t, nil)
	msgs, bytes, err := n.ingest.sub.PendingLimits()
	require.NoError(t, err)
	budget := n.cfg.MaxPendingBytes / 2
	require.Equal(t, natsPendingMsgs(budget, MaxControlLine), msgs)
	require.Positive(t, msgs)
	require.LessOrEqual(t, int64(msgs)*(natsMsgCost+MaxControlLine), budget, "a message costs at least natsMsgCost and a control line")
	require.Equal(t, int(budget-n.nc.MaxPayload()), bytes)
}

// The fault the message bound guards against: a flood of empty messages
// while the intake is held (a descheduled subscription goroutine). Their
// bytes stay far under the NATS client's byte limit, so only the message
// count stops them: NATS drops the rest (a slow consumer), and the intake
// counts the loss and has every engine resync, instead of queuing them
// without bound.
func TestAFloodOfEmptyMessagesIsDroppedByTheMessageBound(t *testing.T) {
	t.Parallel()
	n, nc, _ := startInternal(t, func(c *Config) { c.MaxPendingBytes = 32 << 20 })
	overflow := n.metrics.DroppedBatch(messages.ResyncOverflow)
	msgs, bytes, err := n.ingest.sub.PendingLimits()
	require.NoError(t, err)
	flood := msgs + 1000
	require.Less(t, flood*64, bytes, "the flood's bytes are within the byte limit")

	release := n.HoldIntake()
	defer release()
	for range flood {
		require.NoError(t, nc.Publish("kvactors.e1.heartbeat", nil))
	}
	require.NoError(t, nc.Flush())
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if testutil.ToFloat64(overflow) == 0 {
			return errors.New("no message dropped: the flood queued past the message bound")
		}
		return nil
	})
	pending, _, err := n.ingest.sub.Pending()
	require.NoError(t, err)
	require.LessOrEqual(t, pending, msgs, "queued past the bound")
	// nats.go reports the episode once; the messages it dropped are
	// exported apart, at scrape time (the flood may still be dropping:
	// the scrape lies between two reads of the subscription's count).
	var before int
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if before, err = n.ingest.sub.Dropped(); err == nil && before < 2 {
			err = fmt.Errorf("%d dropped: the flood lost one message so far", before)
		}
		return err
	})
	scraped := gatheredCounter(t, n.cfg.Registry, "kvactors_intake_nats_dropped_total")
	after, err := n.ingest.sub.Dropped()
	require.NoError(t, err)
	require.GreaterOrEqual(t, scraped, float64(before))
	require.LessOrEqual(t, scraped, float64(after))
}

// gatheredCounter is the value of the unlabelled counter name in reg.
func gatheredCounter(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			require.Len(t, mf.GetMetric(), 1)
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// A message's subject and reply ride in the NATS client's queue uncounted
// by its byte limit, and an engine may publish on any verb of its own with
// any reply: messages with long ones, empty bodied, held about 8 × the
// NATS half of --max-pending-bytes at nats-server's 4 KiB control line.
// The embedded server takes control lines of MaxControlLine at most, and
// the count bound prices each message at it.
func TestLongSubjectsAndRepliesStayWithinTheIntakeBudget(t *testing.T) {
	t.Parallel()
	n, nc, _ := startInternal(t, func(c *Config) { c.MaxPendingBytes = 32 << 20 })
	budget := n.cfg.MaxPendingBytes / 2
	msgs, _, err := n.ingest.sub.PendingLimits()
	require.NoError(t, err)
	subj := "kvactors.e1." + strings.Repeat("v", 900)
	reply := "_INBOX.e1." + strings.Repeat("r", 900)

	release := n.HoldIntake()
	defer release()
	for range msgs + 100 {
		require.NoError(t, nc.PublishMsg(&nats.Msg{Subject: subj, Reply: reply}))
	}
	require.NoError(t, nc.Flush())
	testkit.Eventually(t, 20*time.Second, time.Millisecond, func() error {
		if pending, _, _ := n.ingest.sub.Pending(); pending < msgs {
			return fmt.Errorf("%d pending of the bound %d", pending, msgs)
		}
		return nil
	})
	pending, _, err := n.ingest.sub.Pending()
	require.NoError(t, err)
	held := int64(pending) * int64(natsMsgCost+len(subj)+len(reply))
	require.LessOrEqual(t, held, budget, "%d messages of %d subject and reply bytes held past the NATS half of the budget", pending, len(subj)+len(reply))

	// Past the control line the server closes the sender's connection.
	other, err := nats.Connect(n.NATSURL(), nats.NoReconnect())
	require.NoError(t, err)
	defer other.Close()
	closed := make(chan struct{})
	other.SetClosedHandler(func(*nats.Conn) { close(closed) })
	_ = other.PublishMsg(&nats.Msg{Subject: "kvactors.e1." + strings.Repeat("v", 2000), Reply: reply})
	_ = other.Flush()
	testkit.Closed(t, closed, 5*time.Second, "the connection that sent a control line past MaxControlLine closed")
}

// A message may have come with a control line as long as its sender's
// server allows: the embedded server's own limit when it stands alone,
// at least nats-server's default when it has routes (another server's
// clients) or when the server is not the node's.
func TestTheIntakePricesAMessageAtItsSendersControlLine(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts *server.Options
		want int
	}{
		{"external server", nil, defaultMaxControlLine},
		{"embedded, standalone", &server.Options{MaxControlLine: MaxControlLine}, MaxControlLine},
		{"embedded, its config's limit", &server.Options{MaxControlLine: 8192}, 8192},
		{"embedded with a route", &server.Options{MaxControlLine: MaxControlLine, Routes: []*url.URL{{Host: "h:6222"}}}, defaultMaxControlLine},
		{"embedded with a cluster port", &server.Options{MaxControlLine: MaxControlLine, Cluster: server.ClusterOpts{Port: 6222}}, defaultMaxControlLine},
		{"embedded, no limit set", &server.Options{}, defaultMaxControlLine},
	} {
		n := &Node{embeddedOpts: tc.opts}
		require.Equal(t, tc.want, n.controlLine(), tc.name)
	}
}

// docs/SECURITY.md "Bounds": hostile input costs a few log lines per reason
// per minute. An engine flooding the intake makes nats.go report a slow
// consumer once per episode, and a flood is many episodes (an operator
// run: 27 lines in a second from three flooding engines); other async
// errors can come as fast. Each is counted; the first few of a minute are
// logged.
func TestNATSAsyncErrorsAreLogRateLimited(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	n, _, _ := startInternal(t, func(c *Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	onError := n.nc.Opts.AsyncErrorCB
	const episodes = 50
	for range episodes {
		onError(n.nc, n.ingest.sub, nats.ErrSlowConsumer)
		onError(n.nc, nil, nats.ErrPermissionViolation)
	}
	require.Equal(t, float64(episodes), testutil.ToFloat64(n.metrics.NATSEvents.WithLabelValues("slow_consumer")), "every episode counted")
	require.Equal(t, float64(episodes), testutil.ToFloat64(n.metrics.NATSEvents.WithLabelValues("error")), "every error counted")
	require.Equal(t, ratelog.DefaultBurst, strings.Count(logs.String(), nats.ErrSlowConsumer.Error()), "the log holds the first few only")
	require.Equal(t, ratelog.DefaultBurst, strings.Count(logs.String(), nats.ErrPermissionViolation.Error()), "the log holds the first few only")
}
