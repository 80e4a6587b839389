package client

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// A request the node received, whose connection is then closed while the
// reply is awaited, returns ErrConnectionClosed from RequestWithContext, as
// a request refused before any send does: it still counts in last_sent (the
// node heard it; the frees may only come later, never earlier).
func TestARequestSentThenClosedStillCountsAsSent(t *testing.T) {
	t.Parallel()
	s, node := testkit.NATS(t)
	got := make(chan struct{}, 1)
	_, err := node.Subscribe("kvactors.e1.lookup", func(*nats.Msg) { got <- struct{}{} }) // never answers
	require.NoError(t, err)
	require.NoError(t, node.Flush())
	enc, err := nats.Connect(s.ClientURL(), Options("e1")...)
	require.NoError(t, err)
	c := &Client{nc: enc, subj: "kvactors.e1.", cfg: Config{Engine: "e1", RequestTimeout: 5 * time.Second}}
	done := make(chan error, 1)
	before := time.Now()
	go func() { done <- c.requestCtx(context.Background(), "lookup", struct{}{}, &struct{}{}) }()
	select {
	case <-got: // the node took it off NATS
	case <-time.After(5 * time.Second):
		t.Fatal("the request never reached the node")
	}
	enc.Close()
	err = <-done
	require.True(t, errors.Is(err, nats.ErrConnectionClosed), "err %v", err)
	require.False(t, c.sent.latest().Before(before),
		"the request reached the node, yet last_sent forgot it (%v)", c.sent.latest())
}
