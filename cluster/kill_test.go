package cluster

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

// Environment of the owner child process (TestOwnerChildProcess).
const (
	envOwnerURL    = "KVACTORS_TEST_OWNER_URL"
	envOwnerEngine = "KVACTORS_TEST_OWNER_ENGINE"
)

// TestOwnerChildProcess is not a test on its own: run by
// TestKilledOwnerIsTakenOverByItsStandby as a child process, it claims an
// engine, prints "claimed", and keeps it alive every lease/4 until killed.
func TestOwnerChildProcess(t *testing.T) {
	url := os.Getenv(envOwnerURL)
	if url == "" {
		t.Skip("run as a child of TestKilledOwnerIsTakenOverByItsStandby")
	}
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	require.NoError(t, err)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	o, err := OpenOwners(ctx, js, Config{Node: "gpu-0", Boot: fmt.Sprintf("pid%d", os.Getpid()), Lease: testLease, Replicas: 3}, nil)
	require.NoError(t, err)
	engine := os.Getenv(envOwnerEngine)
	d, err := o.Resolve(ctx, engine, Request{Register: true, Local: true, SpecNode: "gpu-0"})
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action)
	fmt.Println("claimed")
	tick := time.NewTicker(testLease / 4)
	for range tick.C { // until SIGKILL
		_, err := o.KeepAlive(ctx, engine)
		require.NoError(t, err)
		fmt.Println("renewed")
	}
}

// An owner process killed with SIGKILL: its standby takes the engine over
// after the lease (never before the lease has passed since the kill's last
// possible renewal), and a node neither named nor standby never does.
func TestKilledOwnerIsTakenOverByItsStandby(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	cmd := exec.Command(os.Args[0], "-test.run=^TestOwnerChildProcess$", "-test.v")
	cmd.Env = append(os.Environ(), envOwnerURL+"="+c.URLs(0), envOwnerEngine+"=e1")
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- strings.TrimSpace(sc.Text())
		}
		close(lines)
	}()
	for got := ""; got != "claimed"; {
		got = testkit.Recv(t, lines, 20*time.Second, "the child's claim")
	}
	// Let it renew twice, so the kill lands on a live, renewing owner.
	for renewed := 0; renewed < 2; {
		if testkit.Recv(t, lines, 5*time.Second, "a renewal by the child") == "renewed" {
			renewed++
		}
	}
	standby := openOwners(t, c.Connect(1), "gpu-0b", "gpu-0", 3)
	other := openOwners(t, c.Connect(2), "gpu-9", "", 3)
	ctx := ctxT(t)
	reg := Request{Register: true, Local: true, SpecNode: "gpu-0"}
	d, err := standby.Resolve(ctx, "e1", reg)
	require.NoError(t, err)
	require.Equal(t, ownership.Ignore, d.Action, "the standby waits while the owner lives")

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	killed := time.Now()
	_ = cmd.Wait()
	testkit.Eventually(t, 10*testLease, 20*time.Millisecond, func() error {
		d, err := other.Resolve(ctx, "e1", reg)
		require.NoError(t, err)
		require.NotEqual(t, ownership.Serve, d.Action, "a node neither named nor standby took the engine")
		d, err = standby.Resolve(ctx, "e1", reg)
		if err != nil {
			return err
		}
		if d.Action != ownership.Serve {
			return fmt.Errorf("standby: %v (%s)", d.Action, d.Reason)
		}
		return nil
	})
	took := time.Since(killed)
	// The child's last renewal was at most lease/4 before the kill.
	require.GreaterOrEqual(t, took, testLease*3/4, "taken over before the lease could have run out")
	t.Logf("standby took over %v after SIGKILL (lease %v)", took, testLease)
	eventuallyOwner(t, other, "e1", "gpu-0b")
}
