"""Who may change the daemon's adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).

Anyone who can connect to the socket may generate (its group is the user gate); the admin routes need more.
Over the Unix socket the peer's uid (SO_PEERCRED) must be the daemon's own user, root, or a member of
`admin_group`; over TCP the request must carry the admin key (`admin_api_key`, or LORAD_ADMIN_API_KEY), and
without one the admin routes are closed to TCP.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from aiohttp import web

from lorad.daemon.server.tcp import carries_key, over_tcp
from lorad.daemon.server.unix_socket import peer_credentials
from lorad.errors import BadRequest, Forbidden

ADMIN_API_KEY_ENV = "LORAD_ADMIN_API_KEY"


@dataclass(frozen=True)
class AdminGate:
    own_uid: int
    group_id: int | None = None  # admin_group's gid
    admin_key: str = ""

    @classmethod
    def from_config(cls, admin_group: str, admin_key: str) -> AdminGate:
        gid = None
        if admin_group:
            try:
                gid = grp.getgrnam(admin_group).gr_gid
            except KeyError:
                raise BadRequest(f"--admin-group {admin_group}: no such group") from None
        return cls(os.geteuid(), gid, admin_key)

    def check(self, request: web.Request) -> None:
        """Forbidden unless the request may change adapters."""
        if over_tcp(request):
            if not carries_key(request, self.admin_key):
                raise Forbidden("adapter admin over TCP needs the admin key (Authorization: Bearer ADMIN_KEY)"
                                if self.admin_key else "adapter admin is closed to TCP: no admin key is set")
            return
        peer = peer_credentials(request.transport)
        if peer is None:
            raise Forbidden("adapter admin needs a peer the kernel can name (SO_PEERCRED)")
        if not self.allows(peer.uid):
            raise Forbidden(f"uid {peer.uid} may not change adapters: the daemon's user, root"
                            + (" or a member of its admin group" if self.group_id is not None else "") + " may")

    def allows(self, uid: int) -> bool:
        if uid in (self.own_uid, 0):
            return True
        if self.group_id is None:
            return False
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        return self.group_id in os.getgrouplist(user.pw_name, user.pw_gid)
