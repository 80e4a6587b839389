package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// demo exits 2 on what serve exits 2 on (docs/OPERATIONS.md "Exit codes":
// every command uses the same table): an OTEL_* value kvactors does not
// support, a --nats URL with credentials, a node setting the node refuses.
func TestDemoConfigErrorsExit2(t *testing.T) {
	for _, c := range []struct {
		name string
		env  [2]string
		args []string
		say  string
	}{
		{name: "bad exporter", env: [2]string{"OTEL_TRACES_EXPORTER", "jaeger"}, say: "tracing: bad configuration"},
		{name: "bad sampler", env: [2]string{"OTEL_TRACES_SAMPLER", "bogus"}, say: "tracing: bad configuration"},
		{name: "nats url with credentials", args: []string{"--nats", "nats://alice:s3cret@127.0.0.1:1"},
			say: "carries credentials"},
		{name: "pool of too many pages", args: []string{"--pool-bytes", "64T"}, say: "bad config"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("OTEL_TRACES_EXPORTER", "console")
			if c.env[0] != "" {
				t.Setenv(c.env[0], c.env[1])
			}
			var out, errb bytes.Buffer
			args := append([]string{"demo", "--quick", "--shm-dir", t.TempDir()}, c.args...)
			require.Equal(t, exitUsage, run(args, &out, &errb), "stderr: %s", errb.String())
			require.Contains(t, errb.String(), c.say)
			require.Contains(t, errb.String(), "--help")
			require.NotContains(t, out.String()+errb.String(), "s3cret")
		})
	}
}
