"""The playground page served at `/` (index.html, app.js, style.css; plain files, no build step)."""
