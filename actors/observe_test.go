package actors_test

import (
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/internal/testkit"
)

type ping struct{ n int }

func TestObserveSeesEveryMessage(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	seen := make(chan any, 16)
	pid := system.Root.Spawn(actor.PropsFromFunc(func(actor.Context) {},
		actor.WithReceiverMiddleware(actors.Observe(seen))))
	system.Root.Send(pid, &ping{1})
	system.Root.Send(pid, &ping{2})
	var got []int
	for len(got) < 2 {
		if p, ok := testkit.Recv(t, seen, 5*time.Second, "observed message").(*ping); ok {
			got = append(got, p.n)
		}
	}
	require.Equal(t, []int{1, 2}, got)
}
