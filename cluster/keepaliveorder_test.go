package cluster

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// refuseUpdatesOf makes every Update of one key fail as a refusal no read
// explains (a compare-and-set on a revision the record is not at), as a
// keep-alive meets it while its own write landed unacknowledged and the
// replica serving its reads has not caught up (docs/CLUSTER.md, "A heal").
type refuseUpdatesOf struct {
	jetstream.KeyValue
	key string
}

func (k *refuseUpdatesOf) Update(ctx context.Context, key string, value []byte, revision uint64) (uint64, error) {
	if key == k.key {
		return k.KeyValue.Update(ctx, key, value, revision+1000)
	}
	return k.KeyValue.Update(ctx, key, value, revision)
}

// One engine whose keep-alive meets an unexplained refusal waits for the
// pass's whole deadline (readPast); a pass that visited it first renewed
// none of the engines after it, and a healthy engine behind it for a lease
// of passes lapsed. Renewed last from its second pass on, it delays nobody.
func TestAnUnsettledKeepAliveDoesNotStarveTheOthers(t *testing.T) {
	const lease = 2 * time.Second
	_, nc := testkit.NATS(t)
	a := openOwnersLease(t, nc, "gpu-a", "", 1, lease)
	mustServe(t, a, "x", Request{Register: true, Local: true})
	mustServe(t, a, "y", Request{Register: true, Local: true})
	a.kv = &refuseUpdatesOf{KeyValue: a.kv, key: "x"}
	renewed := 0
	for pass := 1; pass <= 8; pass++ { // two leases of passes, as node.ownershipLoop runs them
		before := a.Revision("y")
		ctx, cancel := context.WithTimeout(context.Background(), lease/4)
		lost, err := a.KeepAliveAll(ctx)
		t.Logf("pass %d: lost %v, err %v", pass, lost, err)
		cancel()
		if after := a.Revision("y"); after != 0 && after != before {
			renewed++
		}
	}
	// The first pass's order is the map's: x may come first once.
	require.GreaterOrEqual(t, renewed, 7, "y (healthy) renewed in %d of 8 passes", renewed)
	require.True(t, a.Serving("y", time.Now()))
}
