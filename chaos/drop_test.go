//go:build chaos

package chaos_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/sim"
)

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// TestSimWithDroppedBatches (chaos 4) injects the loss of 1% of the
// simulated engine's event batches, at random, in the SDK's transport
// (client.Config.DropBatch). It proves the simulator's oracle still holds:
// every chunk that was ready when its request finished is stored (or
// present), every stored chunk loads back byte for byte, and every
// finished or preempted request is released exactly once per event; each
// loss was recovered by a resync.
func TestSimWithDroppedBatches(t *testing.T) {
	dir, nc := simNode(t)

	cfg := sim.DefaultConfig()
	cfg.ShmDir, cfg.Log = dir, quietLog()
	cfg.DropBatches = 0.01
	cfg.Requests = 300
	cfg.ArrivalsPerStep = 1
	cfg.StepInterval = time.Millisecond
	if *long {
		cfg.Requests = 3000
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := sim.Run(ctx, nc, cfg)
	require.NoError(t, err)
	require.NoError(t, rep.Err(), "first failures: %v", rep.Failures)
	require.Positive(t, rep.DroppedBatches, "1% of %d batches", rep.Batches)
	require.GreaterOrEqual(t, rep.Resyncs, 1)
	require.Zero(t, rep.Missing+rep.MissingReleases+rep.DuplicateReleases+rep.UnknownReleases+rep.VerifyFailed)
	require.Positive(t, rep.VerifyOK)
	t.Logf("%d requests, %d batches: %d dropped, %d resyncs; %d chunks ready, %d stored, %d verified; releases %v",
		rep.Requests, rep.Batches, rep.DroppedBatches, rep.Resyncs, rep.ChunksReady, rep.ChunksStored, rep.VerifyOK,
		rep.Releases)
}
