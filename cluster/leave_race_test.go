package cluster

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// electionKV: Updates are refused by a deposed leader (last below the
// claim); Gets answer no responders after the first `ok` (an election).
type electionKV struct {
	deposedLeaderKV
	ok atomic.Int64
}

func (k *electionKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.ok.Add(-1) >= 0 {
		return k.deposedLeaderKV.KeyValue.Get(ctx, key)
	}
	return nil, nats.ErrNoResponders
}

// A stale refusal below the claim's revision while no replica answers
// reads (the same leader change) until the pass ends: no read shows the
// key below rev, so it is no verdict (it was fenced).
func TestAStaleRefusalWithNoReadAnsweringIsNoFence(t *testing.T) {
	a, _, first := ownerOfE1(t)
	ctx := ctxT(t)
	_, err := a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	real := a.kv
	kv := &electionKV{deposedLeaderKV: deposedLeaderKV{KeyValue: real, last: first}}
	kv.stale.Store(1)
	kv.ok.Store(1) // the keep-alive's check reads fine
	a.kv = kv
	pass, cancel := context.WithTimeout(ctx, staleLease/4)
	defer cancel()
	_, err = a.KeepAlive(pass, "e1")
	t.Logf("err: %v", err)
	require.NotErrorIs(t, err, ErrFenced, "fenced with no read at all")
	require.Equal(t, []string{"e1"}, a.Mine())
	a.kv = real
}

// leaveDuringKV: the first Update (a keep-alive's) lands, then Leave runs
// before the keep-alive's reply is taken.
type leaveDuringKV struct {
	jetstream.KeyValue
	a     *Owners
	once  atomic.Bool
	leave error
}

func (k *leaveDuringKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	n, err := k.KeyValue.Update(ctx, key, value, rev)
	if !k.once.Swap(true) {
		k.leave = k.a.Leave(ctx, key)
	}
	return n, err
}

// A keep-alive landing just before Leave's marker: Leave, refused, finds
// the keep-alive's write its own and puts the marker on it (before, the
// keep-alive, its claim given up, deleted the record and the next boot
// found nothing).
func TestAKeepAliveLandingJustBeforeLeaveLeavesTheMarker(t *testing.T) {
	a, _, _ := ownerOfE1(t)
	ctx := ctxT(t)
	real := a.kv
	kv := &leaveDuringKV{KeyValue: real, a: a}
	a.kv = kv
	_, err := a.KeepAlive(ctx, "e1")
	t.Logf("keep-alive: %v; leave: %v", err, kv.leave)
	a.kv = real
	_, gerr := real.Get(ctx, "e1")
	require.NoError(t, gerr, "no marker left for the next boot")
	e, gerr := a.Get(ctx, "e1")
	require.NoError(t, gerr)
	require.True(t, e.Closed, "the record left is the closed marker")
}
