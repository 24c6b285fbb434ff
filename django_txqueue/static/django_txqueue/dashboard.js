// Re-reads each element with a data-refresh-url (the dashboard's live part, a running item's
// progress) every few seconds while the tab is visible, and keeps the last good copy when a
// request fails (a restart, a lost network): no framework. The server escapes what it sends.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
    for (const live of document.querySelectorAll("[data-refresh-url]")) {
        const refresh = async () => {
            if (document.hidden) return;
            try {
                const response = await fetch(live.dataset.refreshUrl, {
                    credentials: "same-origin",
                    headers: {"X-Requested-With": "XMLHttpRequest"},
                });
                if (response.redirected) window.location.reload();  // logged out: to the login page
                else if (response.ok) live.innerHTML = await response.text();
            } catch (error) {
                // keep showing the last figures; the next tick tries again
            }
        };
        setInterval(refresh, Number(live.dataset.refreshMs) || 5000);
    }
});
