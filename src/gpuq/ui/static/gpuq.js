// The login form: the token goes in an Authorization header, never in a URL or a form body.
document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("login-error");
  const token = document.getElementById("token").value;
  const response = await fetch("/ui/login", {method: "POST", headers: {"Authorization": "Bearer " + token}});
  if (response.ok) {
    window.location.assign("/ui");
  } else {
    error.textContent = (await response.text()).trim();
    error.hidden = false;
  }
});
