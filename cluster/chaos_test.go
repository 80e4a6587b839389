//go:build chaos

package cluster

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// A NATS server that crashes (SIGKILL, no leadership hand-over) while it
// leads the ownership stream: how long do keep-alives fail? The answer
// bounds the lease a cluster needs (docs/CLUSTER.md, Failures). Run:
//
//	go test -tags chaos ./cluster -run NATSServerCrash -v -count 3
func TestNATSServerCrashKeepAliveGap(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "nats-server")
	build := exec.Command("go", "build", "-o", bin, "github.com/nats-io/nats-server/v2")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run(), "build nats-server from the module cache")

	const n = 3
	client, route := ports(t, n), ports(t, n)
	procs := make([]*exec.Cmd, n)
	for i := range n {
		var routes []string
		for j := range n {
			if j != i {
				routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", route[j]))
			}
		}
		cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", fmt.Sprint(client[i]), "-n", fmt.Sprintf("s%d", i),
			"-js", "-sd", t.TempDir(), "--cluster_name", "chaos",
			"--cluster", fmt.Sprintf("nats://127.0.0.1:%d", route[i]), "--routes", strings.Join(routes, ","))
		require.NoError(t, cmd.Start())
		procs[i] = cmd
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	}
	var urls []string
	for _, p := range client {
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", p))
	}
	var nc *nats.Conn
	testkit.Eventually(t, 20*time.Second, 100*time.Millisecond, func() error {
		var err error
		nc, err = nats.Connect(strings.Join(urls, ","), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
		return err
	})
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	lease := 20 * time.Second // the lease docs/CLUSTER.md recommends on a cluster
	var o *Owners
	testkit.Eventually(t, 30*time.Second, 200*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		o, err = OpenOwners(ctx, js, Config{Node: "gpu-0", Boot: "b", Lease: lease, Replicas: 3}, nil)
		return err
	})
	ctx := context.Background()
	_, err = o.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)

	info, err := js.Stream(ctx, "KV_kvactors_owners")
	require.NoError(t, err)
	si, err := info.Info(ctx)
	require.NoError(t, err)
	leader := si.Cluster.Leader
	require.NotEmpty(t, leader)
	var idx int
	_, err = fmt.Sscanf(leader, "s%d", &idx)
	require.NoError(t, err)

	_, err = o.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	last := time.Now()
	require.NoError(t, procs[idx].Process.Signal(syscall.SIGKILL))
	t.Logf("SIGKILL to %s, the ownership stream's leader", leader)
	var failed int
	testkit.Eventually(t, lease, 100*time.Millisecond, func() error {
		kctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := o.KeepAlive(kctx, "e1")
		if err != nil {
			failed++
		}
		return err
	})
	gap := time.Since(last)
	t.Logf("keep-alives failed for %v (%d attempts) after the crash; lease %v", gap, failed, lease)
	require.True(t, o.Serving("e1", time.Now()), "the owner kept its engine through the crash")
	require.Less(t, gap, lease*3/4, "the gap leaves room for lease/4 keep-alive spacing")
}

func ports(t *testing.T, n int) []int {
	out := make([]int, n)
	ls := make([]net.Listener, n)
	for i := range ls {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ls[i], out[i] = l, l.Addr().(*net.TCPAddr).Port
	}
	for _, l := range ls {
		_ = l.Close()
	}
	return out
}
