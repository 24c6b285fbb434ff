// Re-reads the dashboard's live part every few seconds while the tab is visible, and keeps
// the last good copy when a request fails (a restart, a lost network): no framework.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
    const live = document.getElementById("dashboard-live");
    if (!live) return;
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
});
