package testbed

import (
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	ServeIfRequested()
	os.Exit(m.Run())
}
