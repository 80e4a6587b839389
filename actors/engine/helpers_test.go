package engine_test

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvactors/kvactors/metrics"
)

func testutilValue(m *metrics.Metrics) float64 { return testutil.ToFloat64(m.RequestFailure) }

func errString(s string) error { return errors.New(s) }
