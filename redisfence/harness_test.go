package redisfence

import (
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

func TestMain(m *testing.M) { testkit.Main(m) }

type testRedis = testredis.Server

// What these tests take from internal/testredis and internal/testkit.
var (
	startRedis    = testredis.Start
	handlerServer = testkit.Serve
	waitFor       = testkit.WaitFor
	get           = testkit.Get
)
