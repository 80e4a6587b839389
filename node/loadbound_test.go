package node_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// An engine's loads pinned and queued or copying are bounded
// (node.MaxCopyingLoads): past it a load is answered "node overloaded" at
// once, having pinned nothing. Loads go ahead of stores in the copy queue
// and hold pins, not pool room, so one engine loading faster than the
// copies run would otherwise grow the queue without bound. Every copy is
// held; the engine's loads are handled in the order sent, so the one past
// the bound is answered while the others wait; let go, they all load.
func TestAnEnginesLoadsInFlightAreBounded(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 4*node.MaxCopyingLoads), gate: make(chan struct{}, 4*node.MaxCopyingLoads)}
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice, c.Log = dev.wrap, slog.New(slog.NewTextHandler(&logs, nil))
	})
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.oneChunkReady("r")
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy")
	dev.gate <- struct{}{}
	recv(t, te.stored, "r's chunk stored")

	replies := floodLoads(t, e.nc, "e1", []string{hash("r", 0)}, 4, []int{5})
	requireOverloadedFirst(t, replies)
	require.Equal(t, 1.0, e.counter("kvactors_events_rejected_total", "limit"))
	// Logged with the reason it is counted under, as every refusal's line is.
	require.Regexp(t, `level=ERROR msg="load refused" .*reason=limit`, logs.String())

	for range 2 * node.MaxCopyingLoads {
		dev.gate <- struct{}{}
	}
	for range node.MaxCopyingLoads {
		var r messages.LoadReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "a held load's answer").Data, &r))
		require.True(t, r.OK, r.Error)
	}
}

// floodLoads sends node.MaxCopyingLoads+1 loads (the same chunks into the
// same blocks) of engine id over nc, the i'th answered on
// _INBOX.<id>.ld.<i>, and returns the answers as they come.
func floodLoads(t *testing.T, nc *nats.Conn, id string, hashes []string, tokens int, blocks []int) <-chan *nats.Msg {
	t.Helper()
	replies := make(chan *nats.Msg, node.MaxCopyingLoads+1)
	sub, err := nc.ChanSubscribe("_INBOX."+id+".ld.*", replies)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	for i := range node.MaxCopyingLoads + 1 {
		data, err := json.Marshal(map[string]any{"request": fmt.Sprint("l", i), "hashes": hashes,
			"num_tokens": tokens, "blocks": [][]int{blocks}})
		require.NoError(t, err)
		require.NoError(t, nc.PublishRequest("kvactors."+id+".load", fmt.Sprintf("_INBOX.%s.ld.%d", id, i), data))
	}
	return replies
}

// requireOverloadedFirst takes the first answer of a floodLoads: the load
// past the bound's (the last one sent), refused "node overloaded" at once.
func requireOverloadedFirst(t *testing.T, replies <-chan *nats.Msg) {
	t.Helper()
	m := testkit.Recv(t, replies, 10*time.Second, "the answer to the load past the bound")
	require.True(t, strings.HasSuffix(m.Subject, fmt.Sprintf(".%d", node.MaxCopyingLoads)), "answered first: %s %s", m.Subject, m.Data)
	var rep messages.LoadReply
	require.NoError(t, json.Unmarshal(m.Data, &rep))
	require.False(t, rep.OK)
	require.Contains(t, rep.Error, messages.Overloaded)
}
